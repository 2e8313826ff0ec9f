//! The HTTP side: [`app`] builds the axum router (so tests run it in
//! process), [`serve`] runs it with connection limits. The two governed
//! endpoints make the cheap checks first (draining, the guard refusing new
//! work, a full queue, who the caller is), then read and validate the
//! body, count tokens (bounded: one call at most, a deadline, a cap on how
//! many are counted at once), plan, wait for a permit, and forward to the
//! upstream; [`flow`] streams the answer back with the permit inside.
//! GET paths on an allowlist pass through; the governor answers `/metrics`
//! and `/admin/*` itself. Client-facing errors never name the upstream's
//! address (the log does).

mod admin;
mod count;
mod flow;
mod headers;
mod passthrough;
mod serve;
mod timer;

use crate::admission::{Ask, Governor, Permit};
use crate::client::{Answer, UpstreamClient};
use crate::error::GovernError;
use crate::identity::{self, Identity};
use crate::policy;
use crate::request::{self, Endpoint, OutputDecision, ParsedRequest, Prompts};
use crate::settings::Settings;
use crate::tokens::{CountSource, TokenCounter};
pub(crate) use admin::{admin_allowed, from_a_browser, ADMIN_DENIED};
use admin::{admin_reload, admin_state};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{CONTENT_TYPE, HOST};
use axum::http::{HeaderName, HeaderValue, Method, Uri};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
pub(crate) use count::count;
pub(crate) use flow::{stream_back_with, Held, OnEnd, StreamEnd};
pub(crate) use headers::{forward_headers, named, placed_headers, Extra, HOP_BY_HOP};
use passthrough::{metrics, passthrough};
pub use serve::serve;
pub(crate) use serve::serve_router;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reloads the profile (the CLI supplies it); returns the new profile id.
pub type ReloadHook = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

pub struct AppState {
    pub gov: Arc<Governor>,
    pub client: UpstreamClient,
    /// Upstream base URL, no trailing slash.
    pub upstream: String,
    pub counter: TokenCounter,
    pub reload: Option<ReloadHook>,
    /// Where budgets over time keep their buckets (in process by default).
    pub budget_store: Arc<crate::budget::Store>,
    /// Requests being counted at once.
    counting: Arc<tokio::sync::Semaphore>,
    /// The two governed endpoints' URIs and the upstream's Host header,
    /// made once (a URL formatted and parsed every request was 2% of the
    /// governor's instructions, the Host header 3%), or why the base does
    /// not parse, which every send then reports.
    endpoint_uris: Result<([Uri; 2], HeaderValue), String>,
    /// Timers for the wait on an upstream's head, reused.
    head_timers: timer::ReusingTimer,
}

impl AppState {
    pub fn new(gov: Arc<Governor>, upstream: &str, counter: TokenCounter) -> AppState {
        let s = gov.settings();
        headers::warm();
        let upstream = upstream.trim_end_matches('/').to_string();
        let uri = |e: Endpoint| {
            let url = format!("{upstream}{}", e.path());
            url.parse::<Uri>().map_err(|err| format!("{url}: {err}"))
        };
        AppState {
            client: UpstreamClient::counted(
                Duration::from_millis(s.connect_timeout_ms),
                gov.metrics.connection_counters(),
            ),
            counting: Arc::new(tokio::sync::Semaphore::new(s.max_counting)),
            gov,
            endpoint_uris: uri(Endpoint::Completions).and_then(|a| {
                let host = crate::client::host_of(&a)
                    .ok_or_else(|| format!("{upstream}: no host to connect to"))?;
                Ok(([a, uri(Endpoint::Chat)?], host))
            }),
            upstream,
            counter,
            reload: None,
            budget_store: Arc::new(crate::budget::Store::local()),
            head_timers: timer::ReusingTimer::default(),
        }
    }
}

/// The client to the upstream: a connect timeout, no redirects followed.
pub fn upstream_client(s: &Settings) -> UpstreamClient {
    UpstreamClient::new(Duration::from_millis(s.connect_timeout_ms))
}

pub const DEADLINE_HEADER: &str = "x-request-deadline-ms";
const DEADLINE_NAME: HeaderName = HeaderName::from_static(DEADLINE_HEADER);

pub fn app(state: Arc<AppState>) -> Router {
    Endpoint::ALL
        .into_iter()
        .fold(Router::new(), |router, e| {
            router.route(
                e.path(),
                post(move |s: State<Arc<AppState>>, r: Request| governed(s, e, r)),
            )
        })
        .route("/metrics", get(metrics))
        .route("/admin/state", get(admin_state))
        .route("/admin/reload", post(admin_reload))
        .fallback(passthrough)
        .with_state(state)
}

/// The streaming relay on its own (the fuzz target drives it with arbitrary
/// upstream bytes): the upstream's answer back to the client, chunk by
/// chunk, with `permit` released at its end.
pub fn relay(s: &AppState, resp: Answer, permit: Option<Permit>) -> Response {
    let now = Instant::now();
    flow::stream_back(
        s,
        resp,
        permit.map(|permit| Held {
            permit,
            budget: None,
        }),
        Some(now),
        now + Duration::from_millis(s.gov.settings().max_request_ms),
        [],
    )
}

/// Logs `detail` (which may name the upstream) and returns an error for
/// the client that does not.
fn upstream_error(s: &AppState, detail: String, timeout: bool) -> GovernError {
    let e = if timeout {
        GovernError::UpstreamTimeout("no answer in time".into())
    } else {
        GovernError::UpstreamUnreachable("the connection failed".into())
    };
    s.gov.upstream_failed(e.reason());
    tracing::warn!(reason = e.reason(), "upstream: {detail}");
    e
}

/// A refusal of the governor over one upstream (see [`crate::refusal`]).
pub(crate) fn reject(s: &AppState, e: GovernError) -> Response {
    crate::refusal::refuse(&s.gov.metrics, e)
}

async fn governed(State(s): State<Arc<AppState>>, endpoint: Endpoint, req: Request) -> Response {
    let arrived = Instant::now();
    // Cheap checks first: nothing is read or counted for a request that
    // would be refused anyway.
    if let Err(e) = s.gov.precheck() {
        return reject(&s, e);
    }
    let settings = s.gov.settings();
    let who = match identity::identify(&settings.tenants, req.headers()) {
        Ok(w) => w,
        Err(e) => return reject(&s, e),
    };
    let mut r = match handle(&s, &settings, endpoint, req, arrived, &who).await {
        Ok(r) => r,
        Err(e) => reject(&s, e),
    };
    crate::refusal::charged_to(&mut r, &who);
    r
}

async fn read_body(mut body: Body, limit: usize, timeout_ms: u64) -> Result<Bytes, GovernError> {
    use futures::FutureExt;
    use http_body_util::BodyExt;
    // A small body has usually come with the head: one frame at hand, the
    // whole body, taken without a timer, a buffer list or a copy
    // (collecting it was 2% of a request's instructions).
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
pub(crate) struct Incoming {
    pub parts: axum::http::request::Parts,
    pub parsed: ParsedRequest,
    pub arrived: Instant,
    /// When the request must be answered (arrival + its deadline).
    pub deadline: Instant,
    /// The end of its lifetime, queue and answer (max_request_ms).
    pub end: Instant,
}

impl Incoming {
    /// A copy that outlives the request (for work off its path): the same
    /// method, URI, headers, body and times.
    pub(crate) fn detached(&self) -> Incoming {
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
        }
    }
}

/// Reads, bounds and parses a governed request.
pub(crate) async fn read_request(
    settings: &Settings,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
    class: crate::queue::Class,
) -> Result<Incoming, GovernError> {
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > settings.max_body_bytes as u64 {
            // Read to its end and dropped first (up to 8 times the limit,
            // within the body timeout), as nginx's lingering close does:
            // answered while the client is still sending, the client would
            // get a broken pipe instead of the 413.
            if len <= 8 * settings.max_body_bytes as u64 {
                let mut body = body.into_data_stream();
                let drain =
                    async { while let Some(Ok(_)) = futures::StreamExt::next(&mut body).await {} };
                let _ =
                    tokio::time::timeout(Duration::from_millis(settings.body_timeout_ms), drain)
                        .await;
            }
            return Err(GovernError::BodyTooLarge {
                limit_bytes: settings.max_body_bytes,
            });
        }
    }
    let bytes = read_body(body, settings.max_body_bytes, settings.body_timeout_ms).await?;
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
    // The whole request, queue and answer, ends by its lifetime.
    let end = arrived + Duration::from_millis(settings.max_request_ms);
    Ok(Incoming {
        parts,
        parsed,
        arrived,
        deadline: (arrived + Duration::from_millis(deadline_ms)).min(end),
        end,
    })
}

/// Whether placing a request may wait in the admission queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Admit now or not at all (`Ok(None)`): for trying one upstream
    /// before another.
    No,
    /// Queue until the request's deadline.
    UntilDeadline,
}

/// A request placed on one upstream: its admission, its budget
/// reservation (with budgets over time), and what was planned.
pub(crate) struct Placed {
    pub permit: Permit,
    pub budget: Option<crate::budget::Hold>,
    pub plan: policy::Plan,
    pub source: CountSource,
}

impl Placed {
    /// What rides with the answer until it ends.
    pub(crate) fn held(self) -> Held {
        Held {
            permit: self.permit,
            budget: self.budget,
        }
    }
}

/// Counts, plans and admits `inc` on the upstream behind `s`, to be
/// answered by `deadline`.
///
/// # Errors
/// What the governor refuses: a request that can never fit the profile
/// (4xx), one that fits the profile but not today's caps or the queue
/// (429), draining (503). With [`Wait::No`], a request that does not fit
/// right now is `Ok(None)` instead of a 429.
pub(crate) async fn place(
    s: &AppState,
    settings: &Settings,
    inc: &Incoming,
    who: &Identity,
    wait: Wait,
    deadline: Instant,
) -> Result<Option<Placed>, GovernError> {
    let parsed = &inc.parsed;
    let class = who.class;
    let (counts, source) = count(s, settings, parsed).await?;
    s.gov
        .metrics
        .token_counts
        .inc(source as usize, source.label());
    // Against the profile: what can never fit is a 400. Against today's
    // caps (a live guard may have lowered them): what fits the profile but
    // not them is deferred with a 429, never refused for good.
    let plan_for = |limits: &envelope_profile::Limits, max_tokens: Option<u64>| {
        policy::plan(
            limits,
            settings.over_limit,
            settings.beyond,
            parsed.endpoint,
            &counts,
            max_tokens,
            parsed.n,
        )
    };
    let mut plan = match plan_for(&settings.limits, parsed.max_tokens) {
        Ok(p) => p,
        // Counted by the bound after a timeout: not fitting by an upper
        // bound is no reason to refuse for good. Come back when the count
        // can be made.
        Err(e) if source == CountSource::EstimateAfterTimeout && e.status().is_client_error() => {
            return Err(GovernError::Overloaded {
                reason: crate::error::OverloadReason::CountTimeout,
                retry_after_s: 1,
                message: format!(
                    "the prompt could not be counted within {} ms, and by its bytes alone it may not fit ({e}); retry",
                    settings.count_timeout_ms
                ),
            });
        }
        Err(e) => return Err(e),
    };
    let current = s.gov.limits();
    if !plan.fits(&current) {
        // A max_tokens the client asked for (within the profile) is never
        // shortened: it waits for the caps to recover. One we chose
        // (injected or clamped) follows today's caps.
        let shorter = match plan.decision {
            OutputDecision::Kept => None,
            _ => plan_for(&current, parsed.max_tokens)
                .ok()
                .filter(|p| p.fits(&current)),
        };
        plan = match (shorter, wait) {
            (Some(p), _) => p,
            (None, Wait::No) => return Ok(None),
            (None, Wait::UntilDeadline) => return Err(s.gov.tightened(class, plan.demand)),
        };
    }
    let expected_ttft_ms = plan
        .charges
        .iter()
        .filter_map(|c| settings.limits.buckets.get(c.bucket))
        .filter_map(|b| b.ttft_p95_ms)
        .reduce(f64::max);
    // Budgets over time: reserved before the queue (a request over budget
    // does not wait for a slot first), given back if it is not admitted.
    let hold = match &settings.budgets {
        None => None,
        Some(b) => {
            let feature = identity::named(&inc.parts.headers, identity::FEATURE_HEADER)?;
            // A max_tokens the governor chose (injected or clamped) also
            // fits the tightest output budget, rather than reserve more of
            // it than the budget holds.
            let fitted = (plan.decision != OutputDecision::Kept)
                .then(|| b.output_per_seq(&who.tenant, feature.as_deref(), plan.demand.seqs))
                .flatten()
                .filter(|&per_seq| plan.max_tokens > per_seq)
                .and_then(|per_seq| plan_for(&settings.limits, Some(per_seq)).ok())
                .filter(|p| p.fits(&current));
            if let Some(p) = fitted {
                plan = crate::policy::Plan {
                    decision: plan.decision,
                    ..p
                };
            }
            let a = crate::budget::Amounts::of_request(
                b,
                plan.prompt_tokens,
                plan.max_tokens,
                plan.demand.seqs,
            );
            let m = &s.gov.metrics;
            // Boxed, as counting's wait is: only requests with budgets
            // carry its future.
            Box::pin(crate::budget::reserve(
                &s.budget_store,
                b,
                m,
                &who.tenant,
                feature.as_deref(),
                a,
            ))
            .await?
        }
    };
    let ask = Ask {
        tenant: who.tenant.clone(),
        class,
        deadline,
        demand: plan.demand,
        charges: plan.charges.clone(),
        expected_ttft_ms,
    };
    let permit = match wait {
        Wait::UntilDeadline => s.gov.admit(ask).await?,
        Wait::No => match s.gov.try_admit(ask)? {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    s.gov
        .metrics
        .output_decisions
        .inc(plan.decision as usize, plan.decision.label());
    s.gov
        .metrics
        .admitted
        .inc(parsed.endpoint as usize, parsed.endpoint.label());
    Ok(Some(Placed {
        permit,
        budget: hold,
        plan,
        source,
    }))
}

/// Sends a placed request upstream (`parsed` is the request to forward
/// before the output limit is applied) and returns the answer's
/// head, within the upstream timeout and the request's lifetime.
///
/// # Errors
/// The upstream is unreachable or silent (502/504), or the governor is
/// draining (503). The caller still holds the permit.
pub(crate) async fn send(
    s: &AppState,
    settings: &Settings,
    inc: &Incoming,
    parsed: &ParsedRequest,
    placed: &Placed,
) -> Result<Answer, GovernError> {
    let body = parsed.body_with_max_tokens(placed.plan.max_tokens);
    let mut headers = forward_headers(&inc.parts.headers);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let now = Instant::now();
    let timeout = Duration::from_millis(settings.upstream_timeout_ms)
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

async fn handle(
    s: &Arc<AppState>,
    settings: &Arc<Settings>,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
    who: &Identity,
) -> Result<Response, GovernError> {
    let inc = read_request(settings, endpoint, req, arrived, who.class).await?;
    let mut placed = place(s, settings, &inc, who, Wait::UntilDeadline, inc.deadline)
        .await?
        .expect("a request allowed to wait is placed or refused");
    let sent_at = Instant::now();
    // On an error the permit drops with this scope: the reservation is released.
    let resp = match send(s, settings, &inc, &inc.parsed, &placed).await {
        Ok(r) => r,
        Err(e) => {
            // Never reached: budgets get everything back (a timeout keeps it).
            if matches!(e, GovernError::UpstreamUnreachable(_)) {
                if let Some(h) = placed.budget.take() {
                    h.refund();
                }
            }
            return Err(e);
        }
    };
    let extra = placed_headers(&placed);
    let learn = learn_from_usage(s, &placed, &inc.parsed);
    Ok(flow::stream_back_with(
        s,
        resp,
        Some(placed.held()),
        Some(sent_at),
        inc.end,
        extra,
        learn,
    ))
}

/// For a text prompt counted by the learnt estimate: feeds the answer's
/// `usage.prompt_tokens` back into it when the answer ends whole.
fn learn_from_usage(s: &AppState, placed: &Placed, parsed: &ParsedRequest) -> Option<OnEnd> {
    let TokenCounter::Learnt(e) = &s.counter else {
        return None;
    };
    let one_text = matches!(&parsed.prompts, Prompts::Texts(v) if v.len() == 1)
        || matches!(parsed.prompts, Prompts::Messages(_));
    if placed.source != CountSource::Estimate || !one_text {
        return None;
    }
    let (e, bytes) = (e.clone(), crate::tokens::prompt_bytes(&parsed.prompts));
    Some(Box::new(move |end: StreamEnd| {
        if let (true, Some(tokens)) = (end.whole, end.prompt_tokens) {
            e.observe(bytes, tokens);
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

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

    #[test]
    fn hop_by_hop_and_governor_headers_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close"));
        h.insert("x-envelope-tenant", HeaderValue::from_static("a"));
        h.insert(DEADLINE_HEADER, HeaderValue::from_static("5"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        let f = forward_headers(&h);
        assert_eq!(f.len(), 1);
        assert!(f.contains_key("authorization"));
    }
}
