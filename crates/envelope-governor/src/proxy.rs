//! The HTTP side: [`app`] builds the axum router (so tests run it in
//! process), the two governed endpoints read and validate the body, count
//! tokens, plan, wait for a permit, then forward to the upstream and stream
//! the answer back chunk by chunk (reqwest `bytes_stream` -> axum
//! `Body::from_stream`) with the permit riding inside the body stream: when
//! the stream ends, fails, or the client goes away and the body is dropped,
//! the reservation is released. Other GET paths pass through; the governor
//! answers `/metrics` and `/admin/*` itself.

use crate::admission::{Ask, Governor, Permit};
use crate::error::GovernError;
use crate::metrics::label;
use crate::policy;
use crate::queue::Class;
use crate::request::{self, Endpoint, OutputDecision};
use crate::tokens::TokenCounter;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reloads the profile (the CLI supplies it); returns the new profile id.
pub type ReloadHook = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

pub struct AppState {
    pub gov: Arc<Governor>,
    pub client: reqwest::Client,
    /// Upstream base URL, no trailing slash.
    pub upstream: String,
    pub counter: TokenCounter,
    pub reload: Option<ReloadHook>,
}

impl AppState {
    pub fn new(gov: Arc<Governor>, upstream: &str, counter: TokenCounter) -> AppState {
        AppState {
            gov,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(1024)
                .tcp_nodelay(true)
                .build()
                .unwrap_or_default(),
            upstream: upstream.trim_end_matches('/').to_string(),
            counter,
            reload: None,
        }
    }
}

pub const DEADLINE_HEADER: &str = "x-request-deadline-ms";
pub const CLASS_HEADER: &str = "x-envelope-class";

pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route(
            "/v1/completions",
            post(|s: State<Arc<AppState>>, r: Request| governed(s, Endpoint::Completions, r)),
        )
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<AppState>>, r: Request| governed(s, Endpoint::Chat, r)),
        )
        .route("/metrics", get(metrics))
        .route("/admin/state", get(admin_state))
        .route("/admin/reload", post(admin_reload))
        .fallback(passthrough)
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.gov.metrics.render(),
    )
        .into_response()
}

fn admin_allowed(s: &AppState, req: &Request) -> bool {
    let loopback = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .is_some_and(|c| c.0.ip().is_loopback());
    let token = s.gov.settings().admin_token.clone();
    let given = req
        .headers()
        .get("x-envelope-admin-token")
        .and_then(|v| v.to_str().ok());
    loopback || (token.is_some() && given == token.as_deref())
}

async fn admin_state(State(s): State<Arc<AppState>>, req: Request) -> Response {
    if !admin_allowed(&s, &req) {
        return GovernError::Forbidden(
            "admin endpoints answer loopback or a valid x-envelope-admin-token".into(),
        )
        .into_response();
    }
    axum::Json(s.gov.state_json()).into_response()
}

async fn admin_reload(State(s): State<Arc<AppState>>, req: Request) -> Response {
    if !admin_allowed(&s, &req) {
        return GovernError::Forbidden(
            "admin endpoints answer loopback or a valid x-envelope-admin-token".into(),
        )
        .into_response();
    }
    match &s.reload {
        None => GovernError::NotFound("no profile file to reload".into()).into_response(),
        Some(hook) => match hook() {
            Ok(id) => axum::Json(serde_json::json!({"reloaded": true, "profile_id": id})).into_response(),
            Err(e) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(serde_json::json!({"error": {"message": e, "type": "invalid_request_error", "param": null, "code": "invalid_profile"}})),
            )
                .into_response(),
        },
    }
}

/// Read-only paths (and the tokenizer endpoints) go to the upstream as they are.
async fn passthrough(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let allowed = matches!(*req.method(), Method::GET | Method::HEAD)
        || (req.method() == Method::POST && matches!(path.as_str(), "/tokenize" | "/detokenize"));
    if !allowed {
        let e = GovernError::NotFound(format!(
            "{} {path}: the governor forwards GET paths, /tokenize and the two completion endpoints",
            req.method()
        ));
        s.gov.metrics.reject(e.reason());
        return e.into_response();
    }
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or(path);
    let url = format!("{}{pq}", s.upstream);
    let method = req.method().clone();
    let headers = forward_headers(req.headers());
    let body = match axum::body::to_bytes(req.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(_) => {
            return GovernError::BodyTooLarge {
                limit_bytes: 1 << 20,
            }
            .into_response()
        }
    };
    let timeout = Duration::from_millis(s.gov.settings().upstream_timeout_ms);
    let send = s
        .client
        .request(method, &url)
        .headers(headers)
        .body(body)
        .send();
    match tokio::time::timeout(timeout, send).await {
        Ok(Ok(resp)) => stream_back(&s, resp, None, None, Vec::new()),
        Ok(Err(e)) => upstream_error(&s, e.to_string(), false),
        Err(_) => upstream_error(
            &s,
            format!("{url}: no answer in {} ms", timeout.as_millis()),
            true,
        ),
    }
}

fn upstream_error(s: &AppState, message: String, timeout: bool) -> Response {
    let e = if timeout {
        GovernError::UpstreamTimeout(message)
    } else {
        GovernError::UpstreamUnreachable(message)
    };
    s.gov
        .metrics
        .upstream_errors
        .get_or_create(&label("kind", e.reason()))
        .inc();
    s.gov.note_upstream_error();
    tracing::warn!(reason = e.reason(), "{e}");
    e.into_response()
}

const HOP_BY_HOP: &[&str] = &[
    "host",
    "content-length",
    "connection",
    "transfer-encoding",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
];

fn forward_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(h.len());
    for (k, v) in h {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || name == DEADLINE_HEADER || name.starts_with("x-envelope-")
        {
            continue;
        }
        out.append(k.clone(), v.clone());
    }
    out
}

async fn governed(State(s): State<Arc<AppState>>, endpoint: Endpoint, req: Request) -> Response {
    let arrived = Instant::now();
    match handle(&s, endpoint, req, arrived).await {
        Ok(r) => r,
        Err(e) => {
            s.gov.metrics.reject(e.reason());
            if e.status().is_server_error() || e.status() == StatusCode::TOO_MANY_REQUESTS {
                tracing::info!(
                    reason = e.reason(),
                    status = e.status().as_u16(),
                    "refused: {e}"
                );
            } else {
                tracing::debug!(
                    reason = e.reason(),
                    status = e.status().as_u16(),
                    "refused: {e}"
                );
            }
            e.into_response()
        }
    }
}

async fn read_body(body: Body, limit: usize, timeout_ms: u64) -> Result<Bytes, GovernError> {
    match tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        axum::body::to_bytes(body, limit),
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
    }
}

fn tenant_of(s: &AppState, h: &HeaderMap) -> String {
    let settings = s.gov.settings();
    let t = &settings.tenants;
    if let Some(key) = h
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        if let Some(name) = t.tenant_of_key(key.trim()) {
            return name.to_string();
        }
    }
    h.get(t.header.as_str())
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim())
        .filter(|v| !v.is_empty() && v.len() <= 64)
        .map(str::to_string)
        .unwrap_or_else(|| "default".to_string())
}

async fn handle(
    s: &Arc<AppState>,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
) -> Result<Response, GovernError> {
    if s.gov.is_draining() {
        return Err(GovernError::Draining);
    }
    let settings = s.gov.settings();
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        if len > settings.max_body_bytes as u64 {
            return Err(GovernError::BodyTooLarge {
                limit_bytes: settings.max_body_bytes,
            });
        }
    }
    let bytes = read_body(body, settings.max_body_bytes, settings.body_timeout_ms).await?;
    let parsed = request::parse(endpoint, &bytes)?;
    let class = match parts.headers.get(CLASS_HEADER) {
        None => Class::Interactive,
        Some(v) => v.to_str().ok().and_then(Class::parse).ok_or_else(|| {
            GovernError::invalid(
                None,
                format!("header {CLASS_HEADER} must be interactive or batch"),
            )
        })?,
    };
    let deadline_ms = match parts.headers.get(DEADLINE_HEADER) {
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
    let tenant = tenant_of(s, &parts.headers);
    let (counts, source) = s.counter.count(&parsed).await?;
    s.gov
        .metrics
        .token_counts
        .get_or_create(&label("source", source.label()))
        .inc();
    // Against the profile: what can never fit is a 400. Against today's
    // caps (a live guard may have lowered them): what fits the profile but
    // not them is deferred with a 429, never refused for good.
    let plan_for = |limits: &envelope_profile::Limits| {
        policy::plan(
            limits,
            settings.over_limit,
            settings.beyond,
            endpoint,
            &counts,
            parsed.max_tokens,
            parsed.n,
        )
    };
    let mut plan = plan_for(&settings.limits)?;
    let current = s.gov.limits();
    if !plan.fits(&current) {
        // A max_tokens the client asked for (within the profile) is never
        // shortened: it waits for the caps to recover. One we chose
        // (injected or clamped) follows today's caps.
        plan = match plan.decision {
            OutputDecision::Kept => None,
            _ => plan_for(&current).ok().filter(|p| p.fits(&current)),
        }
        .ok_or_else(|| s.gov.tightened(class, plan.demand))?;
    }
    let expected_ttft_ms = plan
        .charges
        .iter()
        .filter_map(|c| settings.limits.buckets.get(c.bucket))
        .filter_map(|b| b.ttft_p95_ms)
        .reduce(f64::max);
    s.gov
        .metrics
        .output_decisions
        .get_or_create(&label("decision", plan.decision.label()))
        .inc();
    let permit = s
        .gov
        .admit(Ask {
            tenant,
            class,
            deadline: arrived + Duration::from_millis(deadline_ms),
            demand: plan.demand,
            charges: plan.charges.clone(),
            expected_ttft_ms,
        })
        .await?;
    s.gov
        .metrics
        .admitted
        .get_or_create(&label("endpoint", endpoint.label()))
        .inc();
    let body = parsed.body_with_max_tokens(&bytes, plan.max_tokens);
    let path = match endpoint {
        Endpoint::Completions => "/v1/completions",
        Endpoint::Chat => "/v1/chat/completions",
    };
    let mut headers = forward_headers(&parts.headers);
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let url = format!("{}{path}", s.upstream);
    let timeout = Duration::from_millis(settings.upstream_timeout_ms);
    s.gov.note_added_latency(arrived.elapsed());
    let sent_at = Instant::now();
    let send = s.client.post(&url).headers(headers).body(body).send();
    let resp = match tokio::time::timeout(timeout, send).await {
        Ok(Ok(r)) => r,
        // The permit drops with this scope: the reservation is released.
        Ok(Err(e)) => return Ok(upstream_error(s, format!("{url}: {e}"), e.is_timeout())),
        Err(_) => {
            return Ok(upstream_error(
                s,
                format!("{url}: no response headers in {} ms", timeout.as_millis()),
                true,
            ))
        }
    };
    let extra = vec![
        ("x-envelope-max-tokens", plan.max_tokens.to_string()),
        (
            "x-envelope-max-tokens-decision",
            plan.decision.label().to_string(),
        ),
        ("x-envelope-prompt-tokens", plan.prompt_tokens.to_string()),
        ("x-envelope-token-count", source.label().to_string()),
        (
            "x-envelope-queue-ms",
            permit.queued_for.as_millis().to_string(),
        ),
    ];
    Ok(stream_back(s, resp, Some(permit), Some(sent_at), extra))
}

/// What rides inside the response body stream.
struct Flow {
    inner: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    permit: Option<Permit>,
    gov: Arc<Governor>,
    sse: bool,
    sent_at: Option<Instant>,
    first_chunk: Option<Instant>,
    last_chunk: Option<Instant>,
    /// A 2xx answer: its timings feed the latency guard.
    ok: bool,
    /// When the last chunk went to the client, and whether the client ever
    /// took long to ask for the next: chunks are timed as the client reads
    /// them, so a slow reader's timings say nothing of the upstream and
    /// must not move the latency guard for everyone.
    yielded_at: Option<Instant>,
    slow_reader: bool,
    idle: Duration,
    /// The last bytes seen, for the `usage` object at the end.
    tail: Vec<u8>,
    events: u64,
    done: bool,
}

const TAIL_BYTES: usize = 4096;

/// A client that takes longer than this to ask for the next chunk is
/// reading slowly (a fast one asks within microseconds).
const SLOW_READER_GAP: Duration = Duration::from_millis(50);

fn find_number(hay: &str, key: &str) -> Option<u64> {
    let i = hay.rfind(key)?;
    let rest = hay[i + key.len()..].trim_start_matches([' ', ':', '"']);
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

impl Flow {
    /// The request's timings for the latency guard: TTFT and mean gap
    /// between events of a stream (events, not chunks, so coalesced chunks
    /// do not hide gaps), or the whole time of a non-streaming answer.
    fn timings(&self) -> (Option<f64>, Option<f64>, Option<f64>) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let Some(sent) = self.sent_at.filter(|_| !self.slow_reader) else {
            return (None, None, None);
        };
        if !self.sse {
            return (None, None, self.last_chunk.map(|t| ms(t - sent)));
        }
        let ttft = self.first_chunk.map(|t| ms(t - sent));
        // Events after the first, less the closing `[DONE]`.
        let gaps = self.events.saturating_sub(2);
        // Several sequences (n > 1, batched prompts) interleave their
        // events, so the gaps between them are not any one's ITL.
        let one_sequence = self.permit.as_ref().is_some_and(|p| p.demand().seqs == 1);
        let itl = match (self.first_chunk, self.last_chunk) {
            (Some(a), Some(b)) if gaps > 0 && one_sequence => Some(ms(b - a) / gaps as f64),
            _ => None,
        };
        (ttft, itl, None)
    }

    fn settle(&mut self) {
        if self.ok {
            if let Some(p) = &self.permit {
                let (ttft, itl, e2e) = self.timings();
                p.record_latency(ttft, itl, e2e);
            }
        }
        if let Some(mut p) = self.permit.take() {
            let tail = String::from_utf8_lossy(&self.tail);
            let used = match (
                find_number(&tail, "\"prompt_tokens\""),
                find_number(&tail, "\"completion_tokens\""),
            ) {
                (Some(a), Some(b)) => Some(a + b),
                // No usage in a stream: one data event is about one token.
                _ if self.sse => Some(self.events.saturating_sub(1)),
                _ => None,
            };
            if let Some(u) = used {
                p.settle(u);
            }
        }
    }

    fn observe_chunk(&mut self, b: &Bytes) {
        let now = Instant::now();
        if self.sse {
            match (self.last_chunk, self.sent_at) {
                (Some(t), _) => self
                    .gov
                    .metrics
                    .inter_chunk
                    .observe((now - t).as_secs_f64()),
                (None, Some(t)) => {
                    self.first_chunk = Some(now);
                    self.gov.metrics.ttft.observe((now - t).as_secs_f64())
                }
                _ => {}
            }
            self.events += b.windows(5).filter(|w| w == b"data:").count() as u64;
        }
        self.last_chunk = Some(now);
        self.tail.extend_from_slice(b);
        if self.tail.len() > TAIL_BYTES {
            let cut = self.tail.len() - TAIL_BYTES;
            self.tail.drain(..cut);
        }
    }
}

fn stream_back(
    s: &AppState,
    resp: reqwest::Response,
    permit: Option<Permit>,
    sent_at: Option<Instant>,
    extra: Vec<(&'static str, String)>,
) -> Response {
    let status = resp.status();
    let mut headers = HeaderMap::with_capacity(resp.headers().len() + extra.len());
    for (k, v) in resp.headers() {
        if !HOP_BY_HOP.contains(&k.as_str()) {
            headers.append(k.clone(), v.clone());
        }
    }
    for (k, v) in extra {
        if let Ok(v) = HeaderValue::from_str(&v) {
            headers.insert(HeaderName::from_static(k), v);
        }
    }
    let sse = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let flow = Flow {
        inner: resp.bytes_stream().boxed(),
        permit,
        gov: s.gov.clone(),
        sse,
        sent_at,
        first_chunk: None,
        last_chunk: None,
        ok: status.is_success(),
        yielded_at: None,
        slow_reader: false,
        idle: Duration::from_millis(s.gov.settings().upstream_idle_timeout_ms),
        tail: Vec::new(),
        events: 0,
        done: false,
    };
    let stream = futures::stream::unfold(flow, |mut f| async move {
        if f.done {
            return None;
        }
        if f.yielded_at.is_some_and(|t| t.elapsed() > SLOW_READER_GAP) {
            f.slow_reader = true;
        }
        let failure = match tokio::time::timeout(f.idle, f.inner.next()).await {
            Ok(Some(Ok(b))) => {
                f.observe_chunk(&b);
                f.yielded_at = Some(Instant::now());
                return Some((Ok::<Bytes, std::io::Error>(b), f));
            }
            Ok(None) => {
                f.settle();
                return None;
            }
            Ok(Some(Err(e))) => ("upstream_stream_error", e.to_string()),
            Err(_) => (
                "upstream_stream_timeout",
                format!("no data from the upstream for {} ms", f.idle.as_millis()),
            ),
        };
        f.done = true;
        f.gov
            .metrics
            .upstream_errors
            .get_or_create(&label("kind", failure.0))
            .inc();
        f.gov.note_upstream_error();
        tracing::warn!(
            kind = failure.0,
            "upstream failed mid-response: {}",
            failure.1
        );
        // Release now, not when the client finally drops the body.
        f.permit.take();
        if f.sse {
            let body = serde_json::json!({"error": {"message": format!("the upstream failed mid-stream: {}", failure.1),
                "type": "server_error", "param": null, "code": failure.0}});
            let ev = Bytes::from(format!("data: {body}\n\n"));
            Some((Ok(ev), f))
        } else {
            Some((Err(std::io::Error::other(failure.1)), f))
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

/// Serves `app` on `listener` (with peer addresses, for the admin check)
/// until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        app(state).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_numbers_are_found_in_the_tail() {
        let t = r#"data: {"usage":{"prompt_tokens":12,"completion_tokens": 30,"total_tokens":42}}"#;
        assert_eq!(find_number(t, "\"prompt_tokens\""), Some(12));
        assert_eq!(find_number(t, "\"completion_tokens\""), Some(30));
        assert_eq!(find_number(t, "\"nope\""), None);
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
