//! Ways around the envelope, each tried from outside: a client
//! that names another tenant or class, hides prompt or output tokens in
//! fields the governor did not read, makes the governor work before
//! admission, holds connections or requests open, reaches the upstream's
//! other paths, or outlives a reload or a drain.

use crate::common;

use common::*;
use envelope_governor::{Settings, TenantsFile, TokenCounter};
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn tenants(text: &str) -> TenantsFile {
    TenantsFile::from_toml(text, "tenants.toml").unwrap()
}

fn estimate() -> Option<TokenCounter> {
    Some(TokenCounter::Estimate {
        bytes_per_token: 3.0,
    })
}

async fn code(r: reqwest::Response) -> (u16, Value) {
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// `n` slow requests sent at once with `auth` (a bearer key) and `headers`.
fn spawn_many(
    g: &Gov,
    n: usize,
    auth: Option<&str>,
    headers: &[(&'static str, String)],
) -> Vec<tokio::task::JoinHandle<(u16, String)>> {
    (0..n)
        .map(|i| {
            let mut req = g
                .client
                .post(g.url("/v1/completions"))
                .json(&json!({"prompt": "a", "max_tokens": 10}));
            if let Some(k) = auth {
                req = req.bearer_auth(k);
            }
            for (k, v) in headers {
                req = req.header(*k, format!("{v}{i}"));
            }
            tokio::spawn(async move {
                let r = req.send().await.unwrap();
                let tenant = r
                    .headers()
                    .get("x-envelope-tenant")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default();
                let s = r.status().as_u16();
                let _ = r.bytes().await;
                (s, tenant)
            })
        })
        .collect()
}

// ---------------------------------------------------------------- identity

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_named_tenant_counts_for_nothing() {
    // Tenants not listed may hold a quarter of 4 sequences. Made-up names
    // used to be tenants of their own, each with its own quarter.
    let t = tenants("default_burst = 0.25\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    g.fake.delay_per_token_ms.store(30, Ordering::SeqCst);
    let tasks = spawn_many(&g, 3, None, &[("x-envelope-tenant", "made-up-".into())]);
    for t in tasks {
        assert_eq!(t.await.unwrap(), (200, "default".to_string()));
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn configured_api_keys_are_required() {
    let t = tenants("[tenants.alice]\napi_keys = [\"sk-alice\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    let url = g.url("/v1/completions");
    for req in [
        g.client.post(&url),
        g.client.post(&url).bearer_auth("sk-mallory"),
        g.client.post(&url).header("x-envelope-tenant", "alice"),
    ] {
        let (s, v) = code(req.json(&body).send().await.unwrap()).await;
        assert_eq!(s, 401, "{v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
    let r = g
        .client
        .post(&url)
        .bearer_auth("sk-alice")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-tenant"], "alice");
    assert_eq!(r.headers()["x-envelope-class"], "interactive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trusted_front_proxy_names_the_tenant() {
    let t = tenants("trusted_header = \"x-forwarded-tenant\"\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .header("x-forwarded-tenant", "team-7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-envelope-tenant"], "team-7");
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .header("x-forwarded-tenant", "no spaces allowed")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_uses_only_its_classes() {
    let t = tenants("[tenants.etl]\napi_keys = [\"sk-etl\"]\nclasses = [\"batch\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    let (s, v) = code(
        g.client
            .post(g.url("/v1/completions"))
            .bearer_auth("sk-etl")
            .header("x-envelope-class", "interactive")
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 403, "{v}");
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .bearer_auth("sk-etl")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-class"], "batch");
}

// ---------------------------------------------------------------- counting

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tools_tool_calls_and_media_parts_are_counted() {
    // The fake's /tokenize counts message contents only, one token a byte.
    let g = start(limits(300, 10, 4, 4000), |s| s.image_part_tokens = 500).await;
    let big = "x".repeat(1000);
    let tools = json!([{"type": "function", "function": {"name": "f", "description": big}}]);
    let calls =
        json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": big}}]);
    let image = json!([{"type": "text", "text": "what is this?"},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]);
    for body in [
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools}),
        json!({"messages": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": null, "tool_calls": calls}]}),
        json!({"messages": [{"role": "user", "content": image}]}),
    ] {
        let (s, v) = code(g.post("/v1/chat/completions", body.clone()).await).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    }
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
    // The same shapes, small, are served.
    let r = g
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}],
                   "tools": [{"type": "function", "function": {"name": "f"}}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_output_and_fan_out_field_is_bounded() {
    let g = start(limits(1000, 10, 2, 4000), |_| {}).await;
    // llama.cpp's n_predict: the limit applied is written to it.
    let r = g
        .post("/v1/completions", json!({"prompt": "a", "n_predict": 5000}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-max-tokens"], "10");
    let sent = g.fake.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(
        (sent["n_predict"].as_u64(), sent["max_tokens"].as_u64()),
        (Some(10), Some(10))
    );
    // -1 (until the context ends) as well.
    let r = g
        .post("/v1/completions", json!({"prompt": "a", "n_predict": -1}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        g.fake.last_body.lock().unwrap().as_ref().unwrap()["n_predict"],
        10
    );
    // A small max_tokens does not hide a large max_new_tokens.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 2, "max_new_tokens": 900}),
        )
        .await;
    assert_eq!(r.headers()["x-envelope-max-tokens"], "10");
    assert_eq!(
        g.fake.last_body.lock().unwrap().as_ref().unwrap()["max_new_tokens"],
        10
    );
    // min_tokens is kept under the limit.
    g.post(
        "/v1/completions",
        json!({"prompt": "a", "max_tokens": 5, "min_tokens": 50}),
    )
    .await;
    assert_eq!(
        g.fake.last_body.lock().unwrap().as_ref().unwrap()["min_tokens"],
        5
    );
    // best_of generates best_of sequences: 4 can never fit 2.
    let before = g.fake.requests.load(Ordering::SeqCst);
    let (s, v) = code(
        g.post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 5, "best_of": 4}),
        )
        .await,
    )
    .await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), before);
}

// ------------------------------------------------------ work before admission

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_refuses_before_counting() {
    let g = start(limits(1000, 10, 1, 4000), |s| s.max_queue_len = 1).await;
    g.fake.delay_per_token_ms.store(50, Ordering::SeqCst);
    let held = spawn_many(&g, 2, None, &[]);
    g.wait_state(|s| s["queue"]["requests"] == 1 && s["in_flight"]["requests"] == 1)
        .await;
    let counted = g.fake.tokenize_calls.load(Ordering::SeqCst);
    assert_eq!(counted, 2);
    let (s, v) = code(
        g.post("/v1/completions", json!({"prompt": "b", "max_tokens": 1}))
            .await,
    )
    .await;
    assert_eq!(s, 429, "{v}");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(g.fake.tokenize_calls.load(Ordering::SeqCst), counted);
    for h in held {
        assert_eq!(h.await.unwrap().0, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn counting_is_one_call_with_a_deadline_and_a_cap() {
    let g = start(limits(100_000, 10, 512, 1_000_000), |s| {
        s.count_timeout_ms = 400;
        s.max_counting = 1;
    })
    .await;
    // A list of 300 prompts: at most one /tokenize call (here none: a list
    // is estimated).
    let prompts: Vec<String> = (0..300).map(|i| format!("p{i}")).collect();
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": prompts, "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(g.fake.tokenize_calls.load(Ordering::SeqCst) <= 1);
    // One request is counted at a time.
    g.fake.tokenize_delay_ms.store(50, Ordering::SeqCst);
    let tasks = spawn_many(&g, 3, None, &[]);
    for t in tasks {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_tokenize_in_flight.load(Ordering::SeqCst), 1);
    // A /tokenize that hangs costs the count timeout, then the estimate counts.
    g.fake.tokenize_delay_ms.store(10_000, Ordering::SeqCst);
    let t0 = Instant::now();
    let r = g
        .post("/v1/completions", json!({"prompt": "a", "max_tokens": 1}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-envelope-token-count"],
        "estimate_after_timeout"
    );
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

/// A prompt that fits, counted by the bound after the upstream's
/// tokenizer took too long (a busy llama-server), is told to come back
/// (429 with Retry-After), never refused for good: the bound is an upper
/// one, and the real count fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_count_that_timed_out_never_refuses_for_good() {
    let g = start(limits(1000, 10, 4, 4000), |s| s.count_timeout_ms = 300).await;
    // The fake counts a byte a token: 989 + 10 fits 1000 exactly counted;
    // the bound (bytes + 2 for special tokens) does not.
    let body = json!({"prompt": "a".repeat(989), "max_tokens": 10});
    let r = g.post("/v1/completions", body.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-token-count"], "upstream_tokenize");
    g.fake.tokenize_delay_ms.store(10_000, Ordering::SeqCst);
    let r = g.post("/v1/completions", body.clone()).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "count_timeout");
    assert!(r.headers().contains_key("retry-after"));
    // What cannot fit even by a count that timed out (fewer tokens than
    // bytes is all a bound says) is still a 400 when counted exactly.
    g.fake.tokenize_delay_ms.store(0, Ordering::SeqCst);
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "a".repeat(995), "max_tokens": 10}),
        )
        .await;
    assert_eq!(r.status(), 400);
}

// ------------------------------------------------------ timeouts and limits

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn headers_that_never_finish_are_cut() {
    let g = start(limits(1000, 10, 4, 4000), |s| {
        s.header_read_timeout_ms = 300
    })
    .await;
    let addr = g.base.trim_start_matches("http://").to_string();
    let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
    sock.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let t0 = Instant::now();
    let mut buf = vec![0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        // Until the governor closes the connection (a 408, then EOF).
        loop {
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the connection is still open after 5 s");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_past_the_cap_wait() {
    let g = start(limits(1000, 10, 4, 4000), |s| s.max_connections = 1).await;
    let addr = g.base.trim_start_matches("http://").to_string();
    // One client holds the only connection open (keep-alive, idle).
    let mut held = tokio::net::TcpStream::connect(&addr).await.unwrap();
    held.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    assert!(held.read(&mut buf).await.unwrap() > 0);
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    assert!(quick.get(g.url("/metrics")).send().await.is_err());
    drop(held);
    let r = reqwest::Client::new()
        .get(g.url("/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A listener whose accept queue is full: connecting to it hangs.
async fn unconnectable() -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>, String) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(1).unwrap();
    let addr = l.local_addr().unwrap();
    let mut held = vec![];
    for _ in 0..16 {
        match tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => held.push(s),
            _ => break,
        }
    }
    (l, held, format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_that_never_accepts_fails_at_the_connect_timeout() {
    let (_l, _held, upstream) = unconnectable().await;
    let (fake, _) = fake_upstream().await;
    let g = start_with(
        fake,
        upstream.clone(),
        limits(1000, 10, 4, 4000),
        |s| {
            s.connect_timeout_ms = 300;
            s.upstream_timeout_ms = 20_000;
        },
        estimate(),
    )
    .await;
    let t0 = Instant::now();
    let r = g
        .post("/v1/completions", json!({"prompt": "a", "max_tokens": 1}))
        .await;
    assert_eq!(r.status(), 502);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // The client's body does not name the upstream.
    let text = r.text().await.unwrap();
    let port = upstream.rsplit(':').next().unwrap();
    assert!(
        !text.contains(port) && !text.contains("127.0.0.1"),
        "{text}"
    );
    assert_eq!(g.state().await["in_flight"]["requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_ends_at_its_lifetime() {
    let g = start(limits(1000, 100, 4, 4000), |s| s.max_request_ms = 800).await;
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    let t0 = Instant::now();
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 40, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("request_lifetime"), "{text}");
    assert!(
        t0.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t0.elapsed()
    );
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["requests"], 0, "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lifetime_ends_a_relay_whose_upstream_never_waits() {
    // An upstream body that always has its next chunk at hand: the relay
    // never waits on it (so never on its timer), and must still end the
    // answer at the request's lifetime.
    let g = start(limits(1000, 100, 4, 4000), |s| s.max_request_ms = 300).await;
    let state = envelope_governor::AppState::new(g.gov.clone(), &g.upstream, estimate().unwrap());
    let endless = futures::stream::repeat_with(|| {
        Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"x"))
    });
    let upstream = axum::http::Response::builder()
        .header("content-type", "application/json")
        .body(axum::body::Body::from_stream(endless))
        .unwrap();
    let answer = envelope_governor::relay(&state, envelope_governor::Answer::from(upstream), None);
    let mut body = answer.into_body().into_data_stream();
    let t0 = Instant::now();
    let mut ended = false;
    while t0.elapsed() < Duration::from_secs(10) {
        match body.next().await {
            Some(Ok(_)) => {}
            // A whole body cut short ends in an error.
            Some(Err(_)) | None => {
                ended = true;
                break;
            }
        }
    }
    assert!(ended, "still relaying after {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_allowlisted_get_paths_reach_the_upstream() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    for path in ["/metrics/", "/debug/pprof", "/v1/../admin", "/server-info"] {
        let r = g.client.get(g.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 0);
    let r = g.client.get(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// The status of a GET of `path` through `g`, with `key` as the bearer.
async fn status_of_get(g: &Gov, path: &str, key: Option<&str>) -> u16 {
    let mut r = g.client.get(g.url(path));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().await.unwrap().status().as_u16()
}

/// With API keys configured, every route the governor forwards needs a
/// known key, not only the completion endpoints; health, readiness and
/// metrics stay public (a kubelet and Prometheus send no key) unless the
/// public paths say otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_keys_every_forwarded_route_needs_one() {
    let t = tenants("[tenants.alice]\napi_keys = [\"sk-alice\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = t).await;
    let get = |path: &'static str, key: Option<&'static str>| status_of_get(&g, path, key);
    for key in [None, Some("sk-mallory")] {
        assert_eq!(get("/v1/models", key).await, 401, "{key:?}");
        assert_eq!(get("/version", key).await, 401, "{key:?}");
        let r = g.client.post(g.url("/tokenize"));
        let r = match key {
            Some(k) => r.bearer_auth(k),
            None => r,
        };
        let r = r.json(&json!({"prompt": "a"})).send().await.unwrap();
        assert_eq!(r.status(), 401, "{key:?}");
    }
    assert_eq!(g.fake.tokenize_calls.load(Ordering::SeqCst), 0);
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 0);
    assert_eq!(get("/v1/models", Some("sk-alice")).await, 200);
    // Public by default: probes and the scrape, without a key.
    for path in ["/health", "/healthz", "/ready", "/metrics"] {
        assert_eq!(get(path, None).await, 200, "{path}");
    }
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 3);

    // Public paths narrowed: /metrics then needs a key too.
    let t = tenants("[tenants.alice]\napi_keys = [\"sk-alice\"]\n");
    let g = start(limits(1000, 10, 4, 4000), move |s| {
        s.tenants = t;
        s.public_paths = vec!["/health".into()];
    })
    .await;
    let get = |path: &'static str, key: Option<&'static str>| status_of_get(&g, path, key);
    assert_eq!(get("/metrics", None).await, 401);
    assert_eq!(get("/ready", None).await, 401);
    assert_eq!(get("/metrics", Some("sk-alice")).await, 200);
    assert_eq!(get("/health", None).await, 200);
}

/// A GET on raw bytes (reqwest would normalise dot segments away first).
async fn raw_get(base: &str, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    c.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    c.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("{text}"))
}

/// A path is decoded before it is judged: `/v1/models/%2e%2e/%2e%2e/x`
/// matches `/v1/models/*` as written but is `/x` to a server that decodes
/// it, so a `.` or `..` segment, encoded or not, is refused; a model name
/// with an encoded slash still passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dot_segments_are_refused_after_decoding() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    for path in [
        "/v1/models/%2e%2e/%2e%2e/debug",
        "/v1/models/%2E%2E/x",
        "/v1/models/../../debug",
        "/v1/models/./x",
        "/v1/models/%2e/x",
    ] {
        assert_eq!(raw_get(&g.base, path).await, 400, "{path}");
    }
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 0);
    assert_eq!(raw_get(&g.base, "/v1/models/org%2Fname").await, 200);
    assert_eq!(g.fake.other_hits.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redirects_are_not_followed() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    g.fake.redirect.store(true, Ordering::SeqCst);
    // A client that does not follow redirects either, to see what came back.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = client
        .post(g.url("/v1/completions"))
        .json(&json!({"prompt": "a", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 307);
    assert_eq!(g.fake.elsewhere_hits.load(Ordering::SeqCst), 0);
}

// ------------------------------------------------------ reload and drain

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_applies_tenants_and_releases_a_removed_guarantee() {
    // `hold` is guaranteed 3 of 4 sequences it does not use: `other` gets 1.
    let before = tenants(
        "[tenants.hold]\nguaranteed = 0.75\napi_keys = [\"sk-hold\"]\n[tenants.other]\napi_keys = [\"sk-other\"]\n",
    );
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = before).await;
    g.fake.delay_per_token_ms.store(30, Ordering::SeqCst);
    for t in spawn_many(&g, 4, Some("sk-other"), &[]) {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 1);
    // Reloaded without `hold`: `other` may use the whole node.
    let mut s: Settings = (*g.gov.settings()).clone();
    s.tenants = tenants("[tenants.other]\napi_keys = [\"sk-other\"]\n");
    g.gov.reload(s).unwrap();
    g.fake.max_seqs_in_flight.store(0, Ordering::SeqCst);
    for t in spawn_many(&g, 4, Some("sk-other"), &[]) {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 4);
    // default_burst applies on reload too.
    let mut s: Settings = (*g.gov.settings()).clone();
    s.tenants = tenants("default_burst = 0.25\n");
    g.gov.reload(s).unwrap();
    g.fake.max_seqs_in_flight.store(0, Ordering::SeqCst);
    for t in spawn_many(&g, 3, None, &[]) {
        assert_eq!(t.await.unwrap().0, 200);
    }
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_refuses_the_queue_cuts_streams_at_the_timeout_and_returns() {
    let (fake, upstream) = fake_upstream().await;
    let (term_tx, term_rx) = tokio::sync::oneshot::channel::<()>();
    let gov_slot: std::sync::Arc<
        std::sync::Mutex<Option<std::sync::Arc<envelope_governor::Governor>>>,
    > = Default::default();
    let slot = gov_slot.clone();
    let shutdown = async move {
        let _ = term_rx.await;
        let gov = slot.lock().unwrap().clone().unwrap();
        gov.drain(Duration::from_millis(500)).await;
    };
    let (g, served) = start_until(
        fake,
        upstream,
        limits(1000, 100, 1, 4000),
        |_| {},
        None,
        shutdown,
    )
    .await;
    *gov_slot.lock().unwrap() = Some(g.gov.clone());
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    // One stream in flight (10 s if left alone), one request queued.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 100, "stream": true}),
        )
        .await;
    let mut stream = r.bytes_stream();
    let streamed = tokio::spawn(async move {
        let mut text = String::new();
        while let Some(Ok(b)) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&b));
        }
        (text, Instant::now())
    });
    let queued = spawn_many(&g, 1, None, &[]);
    g.wait_state(|s| s["queue"]["requests"] == 1).await;
    term_tx.send(()).unwrap();
    // The queued request is refused at once: before the stream in flight
    // is cut at the drain timeout.
    let (s, _) = queued.into_iter().next().unwrap().await.unwrap();
    let refused_at = Instant::now();
    assert_eq!(s, 503);
    // The stream gets an error event at the drain timeout, not its 100
    // tokens.
    let (text, cut_at) = streamed.await.unwrap();
    assert!(
        refused_at < cut_at,
        "the stream ended before the queue was refused"
    );
    assert!(text.contains("\"code\":\"draining\""), "{text}");
    let tokens = text.matches("\"text\"").count();
    assert!(tokens < 100, "{tokens} tokens streamed before the cut");
    // And the server returns (the CLI's process exits then).
    let done = tokio::time::timeout(Duration::from_secs(8), served).await;
    assert!(done.is_ok(), "serve did not return after the drain");
}

// ------------------------------------------------------------------ admin

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_posts_from_a_browser_are_refused() {
    let g = start(limits(1000, 10, 4, 4000), |_| {}).await;
    for (k, v) in [
        ("origin", "http://evil.example"),
        ("sec-fetch-site", "cross-site"),
    ] {
        let r = g
            .client
            .post(g.url("/admin/reload"))
            .header(k, v)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{k}");
    }
    // A script on loopback is not refused (here: no profile file to reload).
    let r = g.client.post(g.url("/admin/reload")).send().await.unwrap();
    assert_eq!(r.status(), 404);
}
