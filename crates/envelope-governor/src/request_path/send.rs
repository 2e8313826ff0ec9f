//! The first half of the relayed stage: a placed request sent upstream,
//! and the answer's head awaited within the upstream timeout and the
//! request's lifetime.

use super::headers::forward_headers;
use super::{GovernedUpstream, Incoming, Placed};
use crate::client::Answer;
use crate::error::GovernError;
use crate::request::ParsedRequest;
use crate::settings::Settings;
use axum::http::header::{CONTENT_TYPE, HOST};
use axum::http::{HeaderValue, Method};
use std::time::{Duration, Instant};

/// Logs `detail` (which may name the upstream) and returns an error for
/// the client that does not.
pub(crate) fn upstream_error(s: &GovernedUpstream, detail: String, timeout: bool) -> GovernError {
    let e = if timeout {
        GovernError::UpstreamTimeout("no answer in time".into())
    } else {
        GovernError::UpstreamUnreachable("the connection failed".into())
    };
    s.gov.upstream_failed(e.reason());
    tracing::warn!(reason = e.reason(), "upstream: {detail}");
    e
}

/// Sends a placed request upstream (`parsed` is the request to forward
/// before the output limit is applied) and returns the answer's
/// head, within the upstream timeout and the request's lifetime.
///
/// # Errors
/// The upstream is unreachable or silent (502/504), or the governor is
/// draining (503). The caller still holds the permit.
pub(crate) async fn send(
    s: &GovernedUpstream,
    settings: &Settings,
    inc: &Incoming,
    parsed: &ParsedRequest,
    placed: &Placed,
) -> Result<Answer, GovernError> {
    let body = parsed.body_with_max_tokens(placed.plan.max_tokens);
    let mut headers = forward_headers(&inc.parts.headers);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let now = Instant::now();
    let timeout = Duration::from_millis(settings.timeouts.upstream_timeout_ms)
        .min(inc.end.saturating_duration_since(now));
    s.gov.note_added_latency(inc.arrived.elapsed());
    if let Some(h) = &placed.budget {
        h.mark_sent();
    }
    let uri = match &s.endpoint_uris {
        Ok((u, host)) => {
            headers.insert(HOST, host.clone());
            u[parsed.endpoint as usize].clone()
        }
        Err(e) => return Err(upstream_error(s, e.clone(), false)),
    };
    let send = s.client.send_to(Method::POST, uri.clone(), headers, body);
    let mut cut = s.gov.cut_signal();
    tokio::select! {
        // In order: no random pick a request.
        biased;
        r = send => match r {
            Ok(r) => Ok(r),
            // Any failure before the head (a connect timeout included) is
            // an unreachable upstream (502), not a slow one.
            Err(e) => Err(upstream_error(s, e, false)),
        },
        () = s.head_timers.sleep_until(now + timeout) => Err(upstream_error(
            s,
            format!("{uri}: no response headers in {} ms", timeout.as_millis()),
            true,
        )),
        _ = cut.wait_for(|c| *c) => Err(GovernError::Draining),
    }
}
