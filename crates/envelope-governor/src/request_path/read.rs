//! The read stage: a governed request's head and body, bounded in size
//! and time, parsed, with its deadline and the end of its lifetime.

use crate::error::GovernError;
use crate::identity;
use crate::queue::Class;
use crate::request::{self, Endpoint, ParsedRequest};
use crate::settings::Settings;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::HeaderName;
use std::time::{Duration, Instant};

pub const DEADLINE_HEADER: &str = "x-request-deadline-ms";
const DEADLINE_NAME: HeaderName = HeaderName::from_static(DEADLINE_HEADER);
/// An endpoint picker's TTFT objective for the request (llm-d's name, then
/// its older alias), ms: the request's TTFT budget, never above its
/// class's.
pub const SLO_TTFT_HEADERS: [&str; 2] = ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"];
/// [`SLO_TTFT_HEADERS`] as names: read on every request, and a lookup by
/// text parses the name each time.
static SLO_TTFT_NAMES: [HeaderName; 2] = [
    HeaderName::from_static(SLO_TTFT_HEADERS[0]),
    HeaderName::from_static(SLO_TTFT_HEADERS[1]),
];

/// The TTFT objective of a request's headers, if any.
///
/// # Errors
/// 400 for a value that is not a positive number of milliseconds.
pub fn slo_ttft_ms(h: &axum::http::HeaderMap) -> Result<Option<f64>, GovernError> {
    let Some((name, v)) = SLO_TTFT_NAMES
        .iter()
        .find_map(|n| h.get(n).map(|v| (n.as_str(), v)))
    else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(Some)
        .ok_or_else(|| {
            GovernError::invalid(
                None,
                format!("header {name} must be a positive number (milliseconds)"),
            )
        })
}

async fn read_body(mut body: Body, limit: usize, timeout_ms: u64) -> Result<Bytes, GovernError> {
    use futures::FutureExt;
    use http_body_util::BodyExt;
    // A small body has usually come with the head: one frame at hand, the
    // whole body, taken without a timer, a buffer list or a copy
    // (docs/measurements/2026-12-06-governor-code-figures.md).
    let mut first = None;
    if let Some(frame) = body.frame().now_or_never() {
        match frame {
            None => return Ok(Bytes::new()),
            Some(Ok(f)) => {
                if let Ok(data) = f.into_data() {
                    if data.len() > limit {
                        return Err(GovernError::BodyTooLarge { limit_bytes: limit });
                    }
                    if http_body::Body::is_end_stream(&body) {
                        return Ok(data);
                    }
                    first = Some(data);
                }
            }
            Some(Err(e)) => {
                return Err(GovernError::invalid(
                    None,
                    format!("reading the request body failed: {e}"),
                ))
            }
        }
    }
    let taken = first.as_ref().map_or(0, Bytes::len);
    let rest = match tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        axum::body::to_bytes(body, limit - taken),
    )
    .await
    {
        Err(_) => Err(GovernError::BodyTimeout { timeout_ms }),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            // to_bytes reports the limit as a LengthLimitError in its source chain.
            let mut src: Option<&dyn std::error::Error> = Some(&e);
            while let Some(x) = src {
                if x.to_string().contains("length limit") {
                    return Err(GovernError::BodyTooLarge { limit_bytes: limit });
                }
                src = x.source();
            }
            Err(GovernError::invalid(
                None,
                format!("reading the request body failed: {e}"),
            ))
        }
    }?;
    Ok(match first {
        None => rest,
        Some(first) => [first, rest].concat().into(),
    })
}

/// A governed request as read: its headers, parsed body (which keeps the
/// body's bytes), deadline and the end of its lifetime.
pub struct Incoming {
    pub parts: axum::http::request::Parts,
    pub parsed: ParsedRequest,
    pub arrived: Instant,
    /// When the request must be answered (arrival + its deadline).
    pub deadline: Instant,
    /// The end of its lifetime, queue and answer (max_request_ms).
    pub end: Instant,
    /// Its TTFT objective from an endpoint picker ([`SLO_TTFT_HEADERS`]).
    pub slo_ttft_ms: Option<f64>,
    /// The feature it serves ([`identity::FEATURE_HEADER`]), for budgets,
    /// cost attribution and the record.
    pub feature: Option<String>,
    /// Its conversation ([`identity::CONVERSATION_HEADER`]), for the
    /// record and the router's escalation memory.
    pub conversation: Option<String>,
}

impl Incoming {
    /// A copy that outlives the request (for work off its path): the same
    /// method, URI, headers, body and times.
    pub fn detached(&self) -> Incoming {
        let mut req = axum::http::Request::new(());
        *req.method_mut() = self.parts.method.clone();
        *req.uri_mut() = self.parts.uri.clone();
        *req.headers_mut() = self.parts.headers.clone();
        let (parts, ()) = req.into_parts();
        Incoming {
            parts,
            parsed: self.parsed.clone(),
            arrived: self.arrived,
            deadline: self.deadline,
            end: self.end,
            slo_ttft_ms: self.slo_ttft_ms,
            feature: self.feature.clone(),
            conversation: self.conversation.clone(),
        }
    }
}

/// Reads, bounds and parses a governed request.
pub async fn read_request(
    settings: &Settings,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
    class: Class,
) -> Result<Incoming, GovernError> {
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > settings.front.max_body_bytes as u64 {
            // Read to its end and dropped first (up to 8 times the limit,
            // within the body timeout), as nginx's lingering close does:
            // answered while the client is still sending, the client would
            // get a broken pipe instead of the 413.
            if len <= 8 * settings.front.max_body_bytes as u64 {
                let mut body = body.into_data_stream();
                let drain =
                    async { while let Some(Ok(_)) = futures::StreamExt::next(&mut body).await {} };
                let _ = tokio::time::timeout(
                    Duration::from_millis(settings.front.body_timeout_ms),
                    drain,
                )
                .await;
            }
            return Err(GovernError::BodyTooLarge {
                limit_bytes: settings.front.max_body_bytes,
            });
        }
    }
    let bytes = read_body(
        body,
        settings.front.max_body_bytes,
        settings.front.body_timeout_ms,
    )
    .await?;
    let parsed = request::parse_bytes(endpoint, bytes)?;
    let deadline_ms = match parts.headers.get(DEADLINE_NAME) {
        None => settings.class_deadline_ms(class),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&v| v > 0)
            .ok_or_else(|| {
                GovernError::invalid(
                    None,
                    format!("header {DEADLINE_HEADER} must be a positive integer (milliseconds)"),
                )
            })?,
    };
    let slo_ttft_ms = slo_ttft_ms(&parts.headers)?;
    // Every header the path acts on is read here, once, and a malformed one
    // is a 400 whatever later uses it.
    let feature = identity::named(&parts.headers, identity::FEATURE_HEADER)?;
    let conversation = identity::named(&parts.headers, identity::CONVERSATION_HEADER)?;
    // The whole request, queue and answer, ends by its lifetime.
    let end = arrived + Duration::from_millis(settings.timeouts.max_request_ms);
    Ok(Incoming {
        parts,
        parsed,
        arrived,
        deadline: (arrived + Duration::from_millis(deadline_ms)).min(end),
        end,
        slo_ttft_ms,
        feature,
        conversation,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A completion request with `headers`, read at `Settings`' defaults.
    async fn read_with(headers: &[(&str, &str)]) -> Result<Incoming, GovernError> {
        let limits = envelope_profile::Limits {
            max_context_tokens: 2048,
            max_output_tokens: 256,
            max_concurrent_seqs: 8,
            max_kv_tokens_in_flight: 8192,
            buckets: vec![],
        };
        let settings = crate::settings::SettingsDraft::new(limits, "p")
            .check()
            .unwrap();
        let mut req = axum::http::Request::post("/v1/completions");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Body::from(r#"{"model":"m","prompt":"hi"}"#))
            .unwrap();
        read_request(
            &settings,
            Endpoint::Completions,
            req,
            Instant::now(),
            Class::Interactive,
        )
        .await
    }

    #[tokio::test]
    async fn the_feature_and_conversation_are_read_once_with_the_request() {
        let inc = read_with(&[
            (identity::FEATURE_HEADER, "search"),
            (identity::CONVERSATION_HEADER, "c-1"),
        ])
        .await
        .unwrap();
        assert_eq!(inc.feature.as_deref(), Some("search"));
        assert_eq!(inc.conversation.as_deref(), Some("c-1"));
        let inc = read_with(&[]).await.unwrap();
        assert_eq!((inc.feature, inc.conversation), (None, None));
        // A malformed one is a 400 here, whatever later stage would use it
        // (budgets, the router, the record).
        for header in [identity::FEATURE_HEADER, identity::CONVERSATION_HEADER] {
            let e = read_with(&[(header, "has spaces")]).await.err().unwrap();
            assert_eq!(e.status().as_u16(), 400, "{header}");
            assert!(e.to_string().contains(header), "{e}");
        }
    }

    #[tokio::test]
    async fn a_body_is_read_whole_in_one_frame_or_several() {
        let read = |b: Body, limit| read_body(b, limit, 1_000);
        // One frame at hand: the body itself.
        assert_eq!(read(Body::from("abc"), 8).await.unwrap(), "abc");
        assert_eq!(read(Body::empty(), 8).await.unwrap(), "");
        // Several frames: the first one at hand, then the rest, in order.
        let chunks = |c: Vec<&'static str>| {
            Body::from_stream(futures::stream::iter(
                c.into_iter()
                    .map(|x| Ok::<_, std::io::Error>(Bytes::from(x))),
            ))
        };
        assert_eq!(
            read(chunks(vec!["ab", "cd", "e"]), 8).await.unwrap(),
            "abcde"
        );
        // Over the limit, in the first frame or across frames.
        for (body, limit) in [(Body::from("abcdef"), 5), (chunks(vec!["abc", "def"]), 5)] {
            match read(body, limit).await {
                Err(GovernError::BodyTooLarge { limit_bytes }) => assert_eq!(limit_bytes, 5),
                other => panic!("{other:?}"),
            }
        }
    }
}
