//! The governor in process in front of a fake upstream: pass-through and
//! streaming, the caps (context, output, concurrency, KV), the queue and
//! its refusals, release on completion, error and client disconnect.

use crate::common;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn assert_openai_error(v: &Value, code: &str) {
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(v["error"]["type"].is_string(), "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_pass_through_chunk_by_chunk_with_headers() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    g.fake.delay_per_token_ms.store(40, Ordering::SeqCst);
    let t0 = Instant::now();
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 10, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(r.headers()["x-envelope-max-tokens"], "10");
    assert_eq!(r.headers()["x-envelope-max-tokens-decision"], "kept");
    assert_eq!(r.headers()["x-envelope-token-count"], "upstream_tokenize");
    assert_eq!(r.headers()["x-envelope-prompt-tokens"], "5");
    let mut s = r.bytes_stream();
    let first = s.next().await.unwrap().unwrap();
    let first_at = t0.elapsed();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    let mut all = first.to_vec();
    while let Some(c) = s.next().await {
        all.extend_from_slice(&c.unwrap());
    }
    let total = t0.elapsed();
    // Not buffered: the first chunk came while the upstream still had 10
    // chunks 40 ms apart to send (over 400 ms to go, however slow the machine).
    assert!(
        total - first_at >= Duration::from_millis(200),
        "first {first_at:?} of {total:?}"
    );
    let text = String::from_utf8(all).unwrap();
    assert_eq!(text.matches("\"text\":\"x\"").count(), 10);
    assert!(text.ends_with("data: [DONE]\n\n"));
    // Byte-identical body: the request was not rewritten (max_tokens kept).
    assert_eq!(
        g.fake.last_body.lock().unwrap().as_ref().unwrap()["max_tokens"],
        10
    );
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["kv_tokens"], 0);
    let m = g.metrics().await;
    assert!(
        m.contains("envelope_governor_time_to_first_chunk_seconds_count 1"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_upstream_is_sent_its_own_host() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    let r = g
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    assert_eq!(r.status(), 200);
    // The governor's base URL names the fake upstream; the client's Host
    // (the governor's own address) is not forwarded.
    let upstream = g.upstream.trim_start_matches("http://").to_string();
    assert_ne!(upstream, g.base.trim_start_matches("http://"));
    assert_eq!(
        g.fake.last_host.lock().unwrap().as_deref(),
        Some(upstream.as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_posts_to_the_governed_paths_are_governed() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let r = g.client.get(g.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 405, "GET {path}");
    }
    // A path that only starts like a governed one is not governed either.
    let r = g.post("/v1/completions/x", json!({"prompt": "hi"})).await;
    assert_eq!(r.status(), 404);
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
    let r = g
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 2}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-max-tokens"], "2");
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn get_paths_pass_through_and_others_are_404() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    let r = g.client.get(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "fake-model");
    let r = g.client.delete(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_openai_error(&r.json().await.unwrap(), "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn context_cap_refuses_before_the_upstream() {
    let g = start(limits(20, 10, 4, 4000), |_| {}).await;
    let r = g
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "0123456789"}], "max_tokens": 10}),
        )
        .await;
    // 10 bytes + 5 template tokens + 10 > 20.
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["x-should-retry"], "false");
    let v: Value = r.json().await.unwrap();
    assert_openai_error(&v, "context_length_exceeded");
    assert_eq!(v["error"]["param"], "messages");
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
    // Token-id prompts count exactly: 15 + 5 = 20 fits, 16 + 5 does not.
    let ids: Vec<u32> = (0..15).collect();
    let r = g
        .post("/v1/completions", json!({"prompt": ids, "max_tokens": 5}))
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-token-count"], "token_ids");
    let ids: Vec<u32> = (0..16).collect();
    let r = g
        .post("/v1/completions", json!({"prompt": ids, "max_tokens": 5}))
        .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["param"], "prompt");
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn output_cap_injects_and_clamps_or_rejects() {
    let g = start(limits(1000, 50, 4, 4000), |_| {}).await;
    let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(r.headers()["x-envelope-max-tokens"], "50");
    assert_eq!(r.headers()["x-envelope-max-tokens-decision"], "injected");
    r.bytes().await.unwrap();
    assert_eq!(
        g.fake.last_body.lock().unwrap().as_ref().unwrap()["max_tokens"],
        50
    );
    let r = g
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000, "temperature": 0.2, "unknown_field": [1]}))
        .await;
    assert_eq!(r.headers()["x-envelope-max-tokens-decision"], "clamped");
    r.bytes().await.unwrap();
    let sent = g.fake.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(sent["max_completion_tokens"], 50);
    // Unknown fields pass through untouched.
    assert_eq!(sent["unknown_field"], json!([1]));
    assert_eq!(sent["temperature"], 0.2);

    let g = start(limits(1000, 50, 4, 4000), |s| {
        s.over_limit = envelope_governor::OverLimit::Reject
    })
    .await;
    let r = g
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 51}))
        .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_openai_error(&v, "max_tokens_over_limit");
    assert_eq!(v["error"]["param"], "max_tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn in_flight_never_exceeds_caps_under_a_burst() {
    // 3 sequences, 90 KV tokens: each request is 5 + 10 = 15 tokens, so the
    // sequence cap binds; n = 2 requests count twice.
    let g = start(limits(1000, 10, 3, 90), |s| {
        s.queue.max_queue_tokens = 10_000
    })
    .await;
    g.fake.delay_per_token_ms.store(3, Ordering::SeqCst);
    let mut tasks = vec![];
    for i in 0..40 {
        let c = g.client.clone();
        let url = g.url("/v1/completions");
        let n = if i % 4 == 0 { 2 } else { 1 };
        let stream = i % 2 == 0;
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(url)
                .json(&json!({"prompt": "hello", "max_tokens": 10, "n": n, "stream": stream}))
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            r.bytes().await.unwrap();
            st
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 40);
    let max = g.fake.max_seqs_in_flight.load(Ordering::SeqCst);
    assert!(max <= 3, "the upstream saw {max} sequences at once");
    assert!(max >= 2, "the burst never overlapped ({max})");
    let st = g.wait_state(|s| s["in_flight"]["sequences"] == 0).await;
    assert_eq!(st["queue"]["requests"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn kv_budget_binds_and_is_never_exceeded() {
    // Each request reserves 5 + 20 = 25 KV tokens; 60 fit two at a time.
    let g = start(limits(1000, 20, 16, 60), |s| {
        s.queue.max_queue_tokens = 10_000
    })
    .await;
    // The first two hold their slots (20 x 100 ms) while the other 18 queue,
    // however slowly they arrive; those then run fast.
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let c = g.client.clone();
            let url = g.url("/v1/completions");
            tokio::spawn(async move {
                c.post(url)
                    .json(&json!({"prompt": "hello", "max_tokens": 20}))
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    g.wait_state(|s| s["queue"]["requests"] == 18).await;
    g.fake.delay_per_token_ms.store(2, Ordering::SeqCst);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let max_kv = g.fake.max_kv_in_flight.load(Ordering::SeqCst);
    assert!(max_kv <= 60, "{max_kv} KV tokens in flight upstream");
    assert_eq!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst), 2);
    let m = g.metrics().await;
    assert_eq!(
        sample(&m, "envelope_governor_reserved_kv_tokens"),
        Some(0.0)
    );
    assert!(
        sample(&m, "envelope_governor_queue_age_seconds_count").unwrap() >= 18.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn never_fitting_requests_are_400_not_429() {
    // Context allows 5 + 100, but the whole KV budget is 50.
    let g = start(limits(1000, 100, 4, 50), |_| {}).await;
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 100}),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert_openai_error(&r.json().await.unwrap(), "context_length_exceeded");
    // n over the concurrency cap.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 1, "n": 5}),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["param"], "n");
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 0);
    let m = g.metrics().await;
    assert!(
        m.contains("envelope_governor_rejections_total{mode=\"single\",reason=\"never_fits\"} 2"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn full_queue_refuses_with_429_and_retry_after() {
    let g = start(limits(1000, 10, 1, 1000), |s| {
        s.queue.max_queue_len = 2;
    })
    .await;
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    // One running (10 x 100 ms: all six arrive meanwhile), two queued, the
    // rest refused.
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let c = g.client.clone();
            let url = g.url("/v1/completions");
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .json(&json!({"prompt": "hello", "max_tokens": 10}))
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let ra = r
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
                let body: Value =
                    serde_json::from_slice(&r.bytes().await.unwrap()).unwrap_or(Value::Null);
                (status, ra, body)
            })
        })
        .collect();
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        let (status, ra, body) = t.await.unwrap();
        match status {
            200 => ok += 1,
            429 => {
                refused += 1;
                let ra = ra.expect("Retry-After");
                assert!((1..=60).contains(&ra), "{ra}");
                assert_openai_error(&body, "rate_limit_exceeded");
                assert_eq!(body["error"]["type"], "rate_limit_error");
            }
            s => panic!("status {s}: {body}"),
        }
    }
    assert_eq!((ok, refused), (3, 3));
    // With service times measured (~1 s each, one at a time), a refusal
    // behind one running and two queued requests says to wait longer. Each
    // wave is let in (running or queued) before the next is sent.
    g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    let mut waves = vec![];
    for i in 0..4u64 {
        let c = g.client.clone();
        let url = g.url("/v1/completions");
        waves.push(tokio::spawn(async move {
            let r = c
                .post(url)
                .json(&json!({"prompt": "hello", "max_tokens": 10}))
                .send()
                .await
                .unwrap();
            let ra = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
            r.bytes().await.unwrap();
            ra
        }));
        if i < 3 {
            g.wait_state(|s| {
                let n = |v: &Value| v["requests"].as_u64().unwrap_or(0);
                n(&s["in_flight"]) + n(&s["queue"]) == i + 1
            })
            .await;
        }
    }
    let mut ras = vec![];
    for w in waves {
        ras.extend(w.await.unwrap());
    }
    assert_eq!(ras.len(), 1, "{ras:?}");
    assert!(
        ras[0] >= 2,
        "Retry-After {} s for ~3 s of work ahead",
        ras[0]
    );
    let m = g.metrics().await;
    assert!(
        m.contains("envelope_governor_rejections_total{mode=\"single\",reason=\"queue_full\"} 4"),
        "{m}"
    );
}

/// A 10-token completion through the governor, with an optional deadline header.
async fn hello(g: &Gov, deadline_ms: Option<&str>) -> reqwest::Response {
    let mut req = g.client.post(g.url("/v1/completions"));
    if let Some(d) = deadline_ms {
        req = req.header("x-request-deadline-ms", d);
    }
    req.json(&json!({"prompt": "hello", "max_tokens": 10}))
        .send()
        .await
        .unwrap()
}

/// [`hello`] on its own task (it holds the only slot); yields its status.
fn spawn_hello(g: &Gov) -> tokio::task::JoinHandle<reqwest::StatusCode> {
    let (client, url) = (g.client.clone(), g.url("/v1/completions"));
    tokio::spawn(async move {
        client
            .post(url)
            .json(&json!({"prompt": "hello", "max_tokens": 10}))
            .send()
            .await
            .unwrap()
            .status()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn deadlines_bound_the_wait() {
    let g = start(limits(1000, 10, 1, 1000), |s| {
        s.queue.max_queue_age_ms = 60_000
    })
    .await;
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    let first = spawn_hello(&g);
    g.wait_state(|s| s["in_flight"]["requests"] == 1).await;
    let t0 = Instant::now();
    let r = hello(&g, Some("200")).await;
    assert_eq!(r.status(), 429);
    // Refused at its deadline, not after the first request's 1 s (the
    // reason says which); the bound only catches a hang.
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(r.headers()["x-envelope-reason"], "queue_timeout");
    assert_eq!(first.await.unwrap(), 200);
    // With a measured drain rate, a hopeless deadline is refused at once.
    g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    let busy = spawn_hello(&g);
    g.wait_state(|s| s["in_flight"]["requests"] == 1).await;
    let t0 = Instant::now();
    let r = hello(&g, Some("50")).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "deadline_unmeetable");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(busy.await.unwrap(), 200);
    // A malformed deadline is a 400.
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .header("x-request-deadline-ms", "soon")
        .json(&json!({"prompt": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_disconnect_mid_stream_releases_the_reservation() {
    let g = start(limits(1000, 100, 2, 1000), |_| {}).await;
    g.fake.delay_per_token_ms.store(50, Ordering::SeqCst);
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 100, "stream": true}),
        )
        .await;
    let mut s = r.bytes_stream();
    s.next().await.unwrap().unwrap();
    let st = g.state().await;
    assert_eq!(st["in_flight"]["kv_tokens"], 105);
    drop(s);
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["kv_tokens"], 0, "{st}");
    // And the upstream stream was dropped too.
    let end = Instant::now() + Duration::from_secs(5);
    while g.fake.seqs_in_flight.load(Ordering::SeqCst) != 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(g.fake.seqs_in_flight.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_disconnect_while_queued_frees_the_slot() {
    let g = start(limits(1000, 10, 1, 1000), |_| {}).await;
    // The first runs 10 x 100 ms: time for the second to queue and leave.
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    let c = g.client.clone();
    let url = g.url("/v1/completions");
    let first = tokio::spawn(async move {
        c.post(url)
            .json(&json!({"prompt": "a", "max_tokens": 10}))
            .send()
            .await
    });
    g.wait_state(|s| s["in_flight"]["requests"] == 1).await;
    let c = g.client.clone();
    let url = g.url("/v1/completions");
    let queued = tokio::spawn(async move {
        c.post(url)
            .json(&json!({"prompt": "b", "max_tokens": 10}))
            .send()
            .await
    });
    g.wait_state(|s| s["queue"]["requests"] == 1).await;
    queued.abort();
    let st = g.wait_state(|s| s["queue"]["requests"] == 0).await;
    assert_eq!(st["queue"]["kv_tokens"], 0);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    let st = g.wait_state(|s| s["in_flight"]["requests"] == 0).await;
    assert_eq!(st["in_flight"]["kv_tokens"], 0);
    assert_eq!(g.fake.requests.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_estimate_learns_bytes_per_token_from_the_upstreams_usage() {
    use envelope_governor::learnt_estimate::{LearntEstimate, MIN_SAMPLES};
    // It starts from 4 bytes a token (as a profile's English text might
    // say); the fake upstream counts one token a byte.
    let (fake, upstream) = fake_upstream().await;
    let learnt = std::sync::Arc::new(LearntEstimate::new(4.0));
    let counter = envelope_governor::TokenCounter::Learnt(learnt.clone());
    let g = start_with(
        fake,
        upstream,
        limits(4000, 100, 4, 40000),
        |_| {},
        Some(counter),
    )
    .await;
    let prompt = "word ".repeat(80);
    let counted = |r: &reqwest::Response| -> u64 {
        assert_eq!(r.headers()["x-envelope-token-count"], "estimate");
        r.headers()["x-envelope-prompt-tokens"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    let body = json!({"prompt": prompt, "max_tokens": 4});
    let r = g.post("/v1/completions", body.clone()).await;
    assert_eq!(counted(&r), 100 + 2);
    r.bytes().await.unwrap();
    for _ in 1..MIN_SAMPLES {
        g.post("/v1/completions", body.clone())
            .await
            .bytes()
            .await
            .unwrap();
    }
    // After enough whole answers, the upstream's own count is followed.
    let r = g.post("/v1/completions", body.clone()).await;
    assert_eq!(counted(&r), 400 + 2);
    assert_eq!(learnt.bytes_per_token(), 1.0);
}

/// The helper every test here waits with fails the test when what it waits
/// for never comes, rather than hand back a state the test then misreads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "did not reach what the test waits for")]
async fn waiting_for_a_state_that_never_comes_fails_the_test() {
    let g = start(limits(1000, 100, 4, 4000), |_| {}).await;
    g.wait_state(|s| s["in_flight"]["requests"] == 99).await;
}
