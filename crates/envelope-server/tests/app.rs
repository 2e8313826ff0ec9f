//! The server in process, through its app builder, on `dummy:tiny`: no
//! model file, no socket.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use envelope_engine::engine::{Engine, EngineHandle, StepRunner};
use envelope_engine::model::SeqChunk;
use envelope_engine::settings::{EngineSettings, KvBudget, Placement};
use envelope_engine::{LoadOptions, Precision};
use envelope_server::{app, AppState};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

/// Panics on any step that holds `POISON`, as a bug in a step would.
struct Poisoned(Box<dyn StepRunner>);

const POISON: u32 = 511;

impl StepRunner for Poisoned {
    fn forward(&mut self, chunks: &[SeqChunk]) -> envelope_engine::Result<Vec<Vec<f32>>> {
        if chunks.iter().any(|c| c.tokens.contains(&POISON)) {
            panic!("poisoned step");
        }
        self.0.forward(chunks)
    }
}

fn server(poisoned: bool) -> (axum::Router, EngineHandle) {
    let opts = LoadOptions {
        precision: Precision::F32,
        tokenizer: None,
    };
    let cfg = EngineSettings {
        kv_budget: KvBudget::Bytes(1 << 20),
        ..EngineSettings::default()
    };
    let (mut engine, template) = Engine::load("dummy:tiny@2", &opts, Placement::Cpu, &cfg).unwrap();
    if poisoned {
        engine = engine.wrap_runner(|r| Box::new(Poisoned(r)));
    }
    let handle = EngineHandle::spawn_engine(engine, template).unwrap();
    (app(AppState::new(handle.clone(), "tiny".into())), handle)
}

async fn call(
    app: &axum::Router,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

fn completion(prompt: &[u32]) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true})
}

fn assert_openai_error(v: &Value) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

#[tokio::test]
async fn a_completion_is_served_without_a_model_file() {
    let (app, handle) = server(false);
    // A fresh server exports every failure reason at 0: a counter family
    // without samples is not valid Prometheus text to every parser.
    let (_, m) = call(&app, "GET", "/metrics", None).await;
    let m = m.as_str().unwrap();
    for reason in ["engine_error", "shut_down"] {
        assert!(
            m.contains(&format!(
                "envelope:request_error_total{{reason=\"{reason}\"}} 0"
            )),
            "{m}"
        );
    }
    let (status, v) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(completion(&[3, 5, 7])),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    handle.shutdown_and_wait();
}

/// A step that panics answers 500 (OpenAI shape) for its request; the next
/// request is served, and `/metrics` counts the panic and the failed
/// requests by reason.
#[tokio::test]
async fn a_panicking_step_answers_500_and_the_next_request_is_served() {
    let (app, handle) = server(true);
    let (status, v) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(completion(&[3, POISON, 7])),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert_openai_error(&v);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("poisoned step"),
        "{v}"
    );
    // Streaming: the error arrives as an SSE event, then [DONE].
    let mut streamed = completion(&[POISON]);
    streamed["stream"] = json!(true);
    let (status, v) = call(&app, "POST", "/v1/completions", Some(streamed)).await;
    assert_eq!(status, StatusCode::OK);
    let text = v.as_str().unwrap();
    assert!(
        text.contains("poisoned step") && text.contains("[DONE]"),
        "{text}"
    );
    for _ in 0..2 {
        let (status, v) = call(
            &app,
            "POST",
            "/v1/completions",
            Some(completion(&[3, 5, 7])),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    let (_, m) = call(&app, "GET", "/metrics", None).await;
    let m = m.as_str().unwrap();
    assert!(m.contains("envelope:engine_step_panics_total 2"), "{m}");
    // Both failed requests are counted under their reason.
    assert!(
        m.contains(r#"envelope:request_error_total{reason="engine_error"} 2"#),
        "{m}"
    );
    handle.shutdown_and_wait();
}

#[tokio::test]
async fn unknown_paths_and_methods_answer_in_the_openai_error_shape() {
    let (app, handle) = server(false);
    let (status, v) = call(&app, "GET", "/v1/nope", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_openai_error(&v);
    let (status, v) = call(&app, "GET", "/v1/completions", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_openai_error(&v);
    let (status, v) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(json!({"model": "other", "prompt": [1]})),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    handle.shutdown_and_wait();
}
