//! `envelope serve`: an OpenAI-compatible HTTP server over the embedded
//! engine. `app` builds the router so tests can drive it in process.

pub mod error;
pub mod metrics;
pub mod openai;

use crate::error::ApiError;
use crate::metrics::ServerMetrics;
use crate::openai::{parse, ChatRequest, CompletionRequest, Prompt, TokenizeRequest};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use envelope_engine::{EngineHandle, Event, GenerateRequest, SamplingParams};
use futures::stream::Stream;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

pub struct AppState {
    pub engine: EngineHandle,
    pub served_model_name: String,
    pub metrics: ServerMetrics,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(engine: EngineHandle, served_model_name: String) -> Arc<AppState> {
        Arc::new(AppState {
            metrics: ServerMetrics::new(engine.metrics.clone(), engine.info.kv_capacity_tokens),
            engine,
            served_model_name,
            next_id: AtomicU64::new(0),
        })
    }
}

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 8 << 20;

pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/tokenize", post(tokenize))
        .route("/metrics", get(metrics))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(refuse_oversized))
        .with_state(state)
}

/// The most of an oversized body read (and dropped) before the 413.
const DRAIN_MAX_BYTES: u64 = 8 * MAX_BODY_BYTES as u64;
/// How long reading it may take.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A body whose declared length is over [`MAX_BODY_BYTES`] gets a 413 in
/// the OpenAI shape, after it has been read to its end and dropped (up to
/// [`DRAIN_MAX_BYTES`], within [`DRAIN_TIMEOUT`]). Answering before the
/// client has sent it all and closing would leave a client still writing
/// with a broken pipe instead of the answer (nginx's lingering close
/// reads on for the same reason).
async fn refuse_oversized(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > MAX_BODY_BYTES as u64 => {
            if n <= DRAIN_MAX_BYTES {
                let mut body = req.into_body().into_data_stream();
                let drain =
                    async { while let Some(Ok(_)) = futures::StreamExt::next(&mut body).await {} };
                let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain).await;
            }
            ApiError::BodyTooLarge {
                limit_bytes: MAX_BODY_BYTES,
            }
            .into_response()
        }
        _ => next.run(req).await,
    }
}

/// An unknown path: 404 in the OpenAI error shape, like every other error.
async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::NoRoute {
        path: uri.path().to_string(),
    }
}

/// A known path with the wrong method: 405 in the OpenAI error shape.
async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::WrongMethod {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &state.served_model_name => {
            Err(ApiError::ModelNotFound { model: m.clone() })
        }
        _ => Ok(()),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.served_model_name,
            "object": "model",
            "created": unix_now(),
            "owned_by": "envelope",
            "root": state.engine.info.model.source,
            "max_model_len": state.engine.info.max_model_len,
        }]
    }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse(&body)?;
    check_model(&state, &req.model)?;
    let e = &state.engine;
    let text = match (req.prompt, req.messages) {
        (Some(p), None) => p,
        (None, Some(m)) => e
            .chat_template
            .render(&openai::messages(&m)?, req.add_generation_prompt)
            .map_err(|e| ApiError::from_engine(e, "messages"))?,
        _ => {
            return Err(ApiError::invalid(
                None,
                "give exactly one of `prompt` and `messages`",
            ))
        }
    };
    let tokens = e
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::from_engine(e.into(), "prompt"))?;
    Ok(Json(
        json!({"count": tokens.len(), "max_model_len": e.info.max_model_len, "tokens": tokens, "token_strs": null}),
    ))
}

/// What a request turned into, ready for the engine.
struct Prepared {
    prompt_tokens: Vec<u32>,
    params: SamplingParams,
    stream: bool,
    include_usage: bool,
}

impl Prepared {
    fn new(prompt_tokens: Vec<u32>, params: SamplingParams, common: &openai::Common) -> Prepared {
        Prepared {
            prompt_tokens,
            params,
            stream: common.stream,
            include_usage: common
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        }
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body)?;
    check_model(&state, &req.common.model)?;
    let e = &state.engine;
    let prompt_tokens = match req.prompt {
        Prompt::Text(s) => e
            .tokenizer
            .encode(&s)
            .map_err(|e| ApiError::from_engine(e.into(), "prompt"))?,
        Prompt::Texts(v) if v.len() == 1 => e
            .tokenizer
            .encode(&v[0])
            .map_err(|e| ApiError::from_engine(e.into(), "prompt"))?,
        Prompt::Texts(_) => {
            return Err(ApiError::invalid(
                Some("prompt".into()),
                "only one prompt per request is supported",
            ))
        }
        Prompt::Tokens(t) => {
            let vocab = e.info.model.config.vocab_size as u32;
            if let Some(bad) = t.iter().find(|&&id| id >= vocab) {
                return Err(ApiError::invalid(
                    Some("prompt".into()),
                    format!("token id {bad} is outside the vocabulary ({vocab})"),
                ));
            }
            t
        }
    };
    let params = openai::sampling(&req.common, req.common.max_tokens, 16)?;
    let p = Prepared::new(prompt_tokens, params, &req.common);
    run(state, p, Kind::Completion).await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(&body)?;
    check_model(&state, &req.common.model)?;
    let e = &state.engine;
    let msgs = openai::messages(&req.messages)?;
    let text = e
        .chat_template
        .render(&msgs, true)
        .map_err(|e| ApiError::from_engine(e, "messages"))?;
    let prompt_tokens = e
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::from_engine(e.into(), "messages"))?;
    // Like vLLM: without a limit, the rest of the context.
    let default_max = e
        .info
        .max_model_len
        .saturating_sub(prompt_tokens.len())
        .max(1);
    let params = openai::sampling(
        &req.common,
        req.max_completion_tokens.or(req.common.max_tokens),
        default_max,
    )?;
    let p = Prepared::new(prompt_tokens, params, &req.common);
    run(state, p, Kind::Chat).await
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn prompt_param(self) -> &'static str {
        match self {
            Kind::Completion => "prompt",
            Kind::Chat => "messages",
        }
    }
}

/// Per-request latency bookkeeping for the histograms.
struct Timer {
    start: Instant,
    last: Option<Instant>,
}

impl Timer {
    fn token(&mut self, m: &ServerMetrics, at: Instant) {
        match self.last {
            None => m.ttft.observe(at.duration_since(self.start).as_secs_f64()),
            Some(prev) => m.itl.observe(at.duration_since(prev).as_secs_f64()),
        }
        self.last = Some(at);
    }
}

async fn run(state: Arc<AppState>, p: Prepared, kind: Kind) -> Result<Response, ApiError> {
    let rx = state
        .engine
        .submit(GenerateRequest {
            prompt_tokens: p.prompt_tokens,
            params: p.params,
        })
        .map_err(|e| ApiError::from_engine(e, kind.prompt_param()))?;
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Completion => format!("cmpl-{:x}{n:08x}", unix_now()),
        Kind::Chat => format!("chatcmpl-{:x}{n:08x}", unix_now()),
    };
    if p.stream {
        let stream = sse_stream(state, rx, kind, id, p.include_usage);
        Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        collect(state, rx, kind, id).await
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn collect(
    state: Arc<AppState>,
    mut rx: UnboundedReceiver<Event>,
    kind: Kind,
    id: String,
) -> Result<Response, ApiError> {
    let mut timer = Timer {
        start: Instant::now(),
        last: None,
    };
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { text: t, at, .. } => {
                timer.token(&state.metrics, at);
                text.push_str(&t);
            }
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                state
                    .metrics
                    .e2e
                    .observe(timer.start.elapsed().as_secs_f64());
                state.metrics.requests_success.inc();
                let choice = match kind {
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason.as_str()})
                    }
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": reason.as_str()})
                    }
                };
                let object = if kind == Kind::Chat {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                return Ok(Json(json!({
                    "id": id, "object": object, "created": unix_now(), "model": state.served_model_name,
                    "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
                }))
                .into_response());
            }
            Event::Error(msg) => {
                return Err(state.metrics.failed(ApiError::Engine { message: msg }));
            }
        }
    }
    Err(state.metrics.failed(ApiError::ShutDown))
}

fn sse_stream(
    state: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    kind: Kind,
    id: String,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    let created = unix_now();
    let object = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let model = state.served_model_name.clone();
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        } else if include_usage {
            v["usage"] = Value::Null;
        }
        SseEvent::default().data(v.to_string())
    };
    let choice = move |text: Option<&str>, role: bool, finish: Option<&str>| match kind {
        Kind::Completion => {
            json!([{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}])
        }
        Kind::Chat => {
            let mut delta = json!({});
            if role {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
        }
    };
    async_stream(state, rx, kind, chunk, choice, include_usage)
}

fn async_stream(
    state: Arc<AppState>,
    rx: UnboundedReceiver<Event>,
    kind: Kind,
    chunk: impl Fn(Value, Option<Value>) -> SseEvent + Send + 'static,
    choice: impl Fn(Option<&str>, bool, Option<&str>) -> Value + Send + 'static,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    struct S<C, H> {
        state: Arc<AppState>,
        rx: UnboundedReceiver<Event>,
        timer: Timer,
        chunk: C,
        choice: H,
        pending: std::collections::VecDeque<SseEvent>,
        done: bool,
        first: bool,
    }
    let s = S {
        state,
        rx,
        timer: Timer {
            start: Instant::now(),
            last: None,
        },
        chunk,
        choice,
        pending: Default::default(),
        done: false,
        first: true,
    };
    futures::stream::unfold(s, move |mut s| async move {
        loop {
            if let Some(ev) = s.pending.pop_front() {
                return Some((Ok(ev), s));
            }
            if s.done {
                return None;
            }
            if s.first && kind == Kind::Chat {
                s.first = false;
                let ev = (s.chunk)((s.choice)(Some(""), true, None), None);
                return Some((Ok(ev), s));
            }
            match s.rx.recv().await {
                Some(Event::Token { text, at, .. }) => {
                    s.timer.token(&s.state.metrics, at);
                    if !text.is_empty() {
                        let ev = (s.chunk)((s.choice)(Some(&text), false, None), None);
                        return Some((Ok(ev), s));
                    }
                }
                Some(Event::Done {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    ..
                }) => {
                    s.state
                        .metrics
                        .e2e
                        .observe(s.timer.start.elapsed().as_secs_f64());
                    s.state.metrics.requests_success.inc();
                    let text = if kind == Kind::Completion {
                        Some("")
                    } else {
                        None
                    };
                    s.pending.push_back((s.chunk)(
                        (s.choice)(text, false, Some(reason.as_str())),
                        None,
                    ));
                    if include_usage {
                        s.pending.push_back((s.chunk)(
                            json!([]),
                            Some(usage(prompt_tokens, completion_tokens)),
                        ));
                    }
                    s.pending.push_back(SseEvent::default().data("[DONE]"));
                    s.done = true;
                }
                Some(Event::Error(msg)) => {
                    let err = s.state.metrics.failed(ApiError::Engine { message: msg });
                    s.pending
                        .push_back(SseEvent::default().data(err.body().to_string()));
                    s.pending.push_back(SseEvent::default().data("[DONE]"));
                    s.done = true;
                }
                None => {
                    let err = s.state.metrics.failed(ApiError::ShutDown);
                    s.pending
                        .push_back(SseEvent::default().data(err.body().to_string()));
                    s.done = true;
                }
            }
        }
    })
}

/// `envelope serve`: logs what `handle` loaded, binds `addr`, prints the
/// line scripts and tests wait for (`envelope serve listening on
/// http://ADDR`) and serves `name` (else the model's own name) on two
/// worker threads until SIGTERM or Ctrl-C; then shuts the engine down.
pub fn serve_blocking(
    handle: EngineHandle,
    name: Option<String>,
    addr: &str,
) -> std::io::Result<()> {
    use std::io::Write;
    let info = handle.info.model.clone();
    tracing::info!(
        "loaded {} in {:.1}s: {} parameters, weights {:.1} MiB ({})",
        info.source,
        info.load_seconds,
        info.weights.num_parameters,
        info.weights.total_bytes as f64 / 1048576.0,
        info.weights.formats.join("+")
    );
    let name = name.unwrap_or_else(|| info.name.clone());
    let ei = &handle.info;
    tracing::info!("backend: {}", ei.backend);
    tracing::info!(
        "KV cache: {} blocks x {} tokens = {} tokens, {:.1} MiB ({} bytes/token, {}); max model len {}",
        ei.kv_blocks_total,
        ei.block_size,
        ei.kv_capacity_tokens,
        ei.kv_pool_bytes as f64 / 1048576.0,
        ei.kv_bytes_per_token,
        ei.kv_dtype,
        ei.max_model_len
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        tracing::info!("serving {name} on http://{local}");
        println!("envelope serve listening on http://{local}");
        std::io::stdout().flush()?;
        let state = AppState::new(handle.clone(), name);
        serve(state, listener).await?;
        handle.shutdown();
        Ok(())
    })
}

/// Serves until SIGTERM or Ctrl-C, then stops accepting and lets in-flight
/// requests finish.
pub async fn serve(state: Arc<AppState>, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down: no new connections, finishing in-flight requests");
}
