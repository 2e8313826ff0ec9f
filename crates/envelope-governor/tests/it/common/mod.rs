//! An in-process fake OpenAI-compatible upstream that the tests control
//! (delay per token, hang, die mid-stream, KV usage in /metrics) and that
//! records what reached it (requests, sequences and KV tokens in flight,
//! their maxima), plus a governor in front of it on loopback.
#![allow(dead_code)]

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use envelope_governor::{GovernedUpstream, Governor, SettingsDraft, TokenCounter};
use envelope_profile::Limits;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
pub struct Fake {
    pub delay_per_token_ms: AtomicU64,
    /// Never answer (headers never come).
    pub hang: AtomicBool,
    /// Stop the stream (connection error) after this many chunks; 0 = never.
    pub die_after_chunks: AtomicU64,
    /// Stall (no more bytes, connection open) after this many chunks; 0 = never.
    pub stall_after_chunks: AtomicU64,
    pub kv_usage_milli: AtomicU64,
    /// /metrics answers 404 (as a server without Prometheus metrics does).
    pub no_metrics: AtomicBool,
    pub requests: AtomicU64,
    pub seqs_in_flight: AtomicI64,
    pub max_seqs_in_flight: AtomicI64,
    pub kv_in_flight: AtomicI64,
    pub max_kv_in_flight: AtomicI64,
    pub last_body: Mutex<Option<Value>>,
    /// The Host header of the last completion request.
    pub last_host: Mutex<Option<String>>,
    /// /tokenize: calls, most at once, and a delay before answering.
    pub tokenize_calls: AtomicU64,
    pub tokenize_in_flight: AtomicI64,
    pub max_tokenize_in_flight: AtomicI64,
    pub tokenize_delay_ms: AtomicU64,
    /// The completion endpoints answer 307 to /elsewhere.
    pub redirect: AtomicBool,
    /// Requests that reached /elsewhere, and any path without a route.
    pub elsewhere_hits: AtomicU64,
    pub other_hits: AtomicU64,
}

/// Decrements the in-flight counters when the handler or its stream ends.
struct InFlight {
    fake: Arc<Fake>,
    seqs: i64,
    kv: i64,
}

impl InFlight {
    fn new(fake: Arc<Fake>, seqs: i64, kv: i64) -> InFlight {
        let s = fake.seqs_in_flight.fetch_add(seqs, Ordering::SeqCst) + seqs;
        fake.max_seqs_in_flight.fetch_max(s, Ordering::SeqCst);
        let k = fake.kv_in_flight.fetch_add(kv, Ordering::SeqCst) + kv;
        fake.max_kv_in_flight.fetch_max(k, Ordering::SeqCst);
        InFlight { fake, seqs, kv }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.fake
            .seqs_in_flight
            .fetch_sub(self.seqs, Ordering::SeqCst);
        self.fake.kv_in_flight.fetch_sub(self.kv, Ordering::SeqCst);
    }
}

/// The fake counts one token per byte of prompt text (like a byte tokenizer).
fn prompt_tokens(body: &Value) -> u64 {
    if let Some(p) = body.get("prompt") {
        return match p {
            Value::String(s) => s.len() as u64,
            Value::Array(a) => a
                .iter()
                .map(|x| x.as_str().map(|s| s.len()).unwrap_or(1) as u64)
                .sum(),
            _ => 1,
        };
    }
    body.get("messages")
        .and_then(Value::as_array)
        .map(|m| {
            m.iter()
                .map(|x| x["content"].as_str().unwrap_or("").len() as u64)
                .sum()
        })
        .unwrap_or(0)
}

async fn generate(
    State(fake): State<Arc<Fake>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    fake.requests.fetch_add(1, Ordering::SeqCst);
    *fake.last_host.lock().unwrap() = headers
        .get("host")
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    *fake.last_body.lock().unwrap() = Some(v.clone());
    if fake.redirect.load(Ordering::SeqCst) {
        return Response::builder()
            .status(307)
            .header("location", "/elsewhere")
            .body(Body::empty())
            .unwrap();
    }
    if fake.hang.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    let n = v["n"].as_u64().unwrap_or(1) as i64;
    let max_tokens = v["max_tokens"]
        .as_u64()
        .or(v["max_completion_tokens"].as_u64())
        .unwrap_or(16);
    let prompt = prompt_tokens(&v);
    let guard = InFlight::new(fake.clone(), n, ((prompt + max_tokens) as i64) * n);
    let delay = Duration::from_millis(fake.delay_per_token_ms.load(Ordering::SeqCst));
    let usage = json!({"prompt_tokens": prompt, "completion_tokens": max_tokens, "total_tokens": prompt + max_tokens});
    if v["stream"].as_bool() == Some(true) {
        let die = fake.die_after_chunks.load(Ordering::SeqCst);
        let stall = fake.stall_after_chunks.load(Ordering::SeqCst);
        let stream = futures::stream::unfold((0u64, guard), move |(i, g)| {
            let usage = usage.clone();
            async move {
                if i > max_tokens {
                    return None;
                }
                if die > 0 && i == die {
                    return Some((Err(std::io::Error::other("fake upstream died")), (i + 1, g)));
                }
                if stall > 0 && i == stall {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                tokio::time::sleep(delay).await;
                let chunk = if i == max_tokens {
                    format!(
                        "data: {}\n\ndata: [DONE]\n\n",
                        json!({"choices": [], "usage": usage})
                    )
                } else {
                    format!(
                        "data: {}\n\n",
                        json!({"choices": [{"index": 0, "text": "x", "finish_reason": null}]})
                    )
                };
                Some((Ok::<Bytes, std::io::Error>(Bytes::from(chunk)), (i + 1, g)))
            }
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    tokio::time::sleep(delay * max_tokens as u32).await;
    let whole = json!({"id": "x", "object": "text_completion",
        "choices": [{"index": 0, "text": "x".repeat(max_tokens as usize), "finish_reason": "length"}],
        "usage": usage});
    if fake.die_after_chunks.load(Ordering::SeqCst) > 0 {
        // The whole body's length, then half of it and a dead connection.
        let bytes = Bytes::from(whole.to_string());
        let half = bytes.slice(..bytes.len() / 2);
        // The half goes out (with the head) before the connection dies.
        let body = futures::stream::unfold((0, guard), move |(i, g)| {
            let half = half.clone();
            async move {
                match i {
                    0 => Some((Ok(half), (1, g))),
                    1 => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Some((Err(std::io::Error::other("fake upstream died")), (2, g)))
                    }
                    _ => None,
                }
            }
        });
        return Response::builder()
            .header("content-type", "application/json")
            .header("content-length", bytes.len())
            .body(Body::from_stream(body))
            .unwrap();
    }
    drop(guard);
    Json(whole).into_response()
}

async fn tokenize(State(fake): State<Arc<Fake>>, Json(v): Json<Value>) -> Json<Value> {
    fake.tokenize_calls.fetch_add(1, Ordering::SeqCst);
    let now = fake.tokenize_in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    fake.max_tokenize_in_flight.fetch_max(now, Ordering::SeqCst);
    let delay = fake.tokenize_delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    fake.tokenize_in_flight.fetch_sub(1, Ordering::SeqCst);
    Json(json!({"count": prompt_tokens(&v) + if v.get("messages").is_some() { 5 } else { 0 }}))
}

async fn metrics(State(fake): State<Arc<Fake>>) -> Response {
    if fake.no_metrics.load(Ordering::SeqCst) {
        return (axum::http::StatusCode::NOT_FOUND, "404 page not found").into_response();
    }
    let kv = fake.kv_usage_milli.load(Ordering::SeqCst) as f64 / 1000.0;
    format!(
        "# TYPE envelope:kv_cache_usage_perc gauge\nenvelope:kv_cache_usage_perc {kv}\n# TYPE envelope:num_preemptions_total counter\nenvelope:num_preemptions_total 0\n# TYPE envelope:num_requests_running gauge\nenvelope:num_requests_running {}\n",
        fake.seqs_in_flight.load(Ordering::SeqCst)
    )
    .into_response()
}

/// Starts the fake; returns it and its base URL.
pub async fn fake_upstream() -> (Arc<Fake>, String) {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate))
        .route(
            "/v1/models",
            get(|| async { Json(json!({"object": "list", "data": [{"id": "fake-model"}]})) }),
        )
        .route("/tokenize", post(tokenize))
        .route("/metrics", get(metrics))
        .route(
            "/elsewhere",
            axum::routing::any(|State(f): State<Arc<Fake>>| async move {
                f.elsewhere_hits.fetch_add(1, Ordering::SeqCst);
                "elsewhere"
            }),
        )
        .fallback(|State(f): State<Arc<Fake>>| async move {
            f.other_hits.fetch_add(1, Ordering::SeqCst);
            "an upstream debug page"
        })
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (fake, format!("http://{addr}"))
}

pub fn limits(ctx: u64, out: u64, seqs: u64, kv: u64) -> Limits {
    Limits {
        max_context_tokens: ctx,
        max_output_tokens: out,
        max_concurrent_seqs: seqs,
        max_kv_tokens_in_flight: kv,
        buckets: vec![],
    }
}

pub struct Gov {
    pub gov: Arc<Governor>,
    pub base: String,
    pub fake: Arc<Fake>,
    pub upstream: String,
    pub client: reqwest::Client,
}

impl Gov {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub async fn state(&self) -> Value {
        self.client
            .get(self.url("/admin/state"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Polls /admin/state until `f` holds and returns that state; fails the
    /// test when it does not hold within 5 s.
    pub async fn wait_state(&self, f: impl Fn(&Value) -> bool) -> Value {
        let end = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let s = self.state().await;
            if f(&s) {
                return s;
            }
            assert!(
                std::time::Instant::now() < end,
                "the state did not reach what the test waits for in 5 s: {s}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A fake upstream and a governor in front of it; `tune` adjusts settings.
pub async fn start(limits: Limits, tune: impl FnOnce(&mut SettingsDraft)) -> Gov {
    let (fake, upstream) = fake_upstream().await;
    start_with(fake, upstream, limits, tune, None).await
}

pub async fn start_with(
    fake: Arc<Fake>,
    upstream: String,
    limits: Limits,
    tune: impl FnOnce(&mut SettingsDraft),
    counter: Option<TokenCounter>,
) -> Gov {
    start_until(
        fake,
        upstream,
        limits,
        tune,
        counter,
        std::future::pending(),
    )
    .await
    .0
}

/// As [`start_with`], serving until `shutdown` resolves; the handle ends
/// when the server has returned.
pub async fn start_until(
    fake: Arc<Fake>,
    upstream: String,
    limits: Limits,
    tune: impl FnOnce(&mut SettingsDraft),
    counter: Option<TokenCounter>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> (Gov, tokio::task::JoinHandle<std::io::Result<()>>) {
    let mut s = SettingsDraft::new(limits, "test-profile");
    tune(&mut s);
    let gov = Governor::new(s.check().unwrap());
    let counter = counter.unwrap_or(TokenCounter::Upstream {
        client: envelope_governor::UpstreamClient::new(Duration::from_secs(5)),
        url: format!("{upstream}/tokenize"),
        timeout: Duration::from_secs(5),
        dialect: envelope_governor::upstream_tokenize::Dialect::Vllm,
        chat: Default::default(),
    });
    let state = Arc::new(GovernedUpstream::new(gov.clone(), &upstream, counter));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = tokio::spawn(envelope_governor::serve(listener, state, shutdown));
    let g = Gov {
        gov,
        base: format!("http://{addr}"),
        fake,
        upstream,
        client: reqwest::Client::new(),
    };
    (g, served)
}

/// The value of an unlabelled or exactly-labelled sample in Prometheus text.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}
