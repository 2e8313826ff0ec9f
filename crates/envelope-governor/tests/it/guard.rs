//! The live guard's ladder against the fake's /metrics, tenants' shares,
//! the estimate label, /metrics and the admin endpoints, and reload.

use crate::common;

use common::*;
use envelope_governor::{live_guard, Level, TenantsSettings, TokenCounter};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn live_guard_ladder_from_upstream_metrics() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.ladder.recover_readings = 2;
    })
    .await;
    let _task = live_guard::spawn_guard(
        g.gov.clone(),
        format!("{}/metrics", g.upstream),
        Duration::from_millis(50),
        true,
    );
    // Healthy: a request gets the full output cap.
    let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(r.headers()["x-envelope-max-tokens"], "100");
    // KV pressure: tighter caps (SMALL_CONTEXT halves them).
    g.fake.kv_usage_milli.store(930, Ordering::SeqCst);
    g.wait_state(|s| s["ladder"]["level"] == "small_context")
        .await;
    let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(r.headers()["x-envelope-max-tokens"], "50");
    // A request that fits the profile but not the tightened caps is
    // deferred (429 with Retry-After), not refused for good (400).
    let r = g
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 80}))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "guard_tightened");
    assert!(r.headers().get("x-should-retry").is_none());
    let ra: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&ra));
    // max_tokens over the cap is clamped (the client left it to us): to
    // today's cap.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 999}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-max-tokens"], "50");
    // What can never fit the profile is still a 400.
    let r = g
        .post("/v1/completions", json!({"prompt": "x".repeat(1000)}))
        .await;
    assert_eq!(r.status(), 400);
    // Near full: new requests refused with 429 and Retry-After.
    g.fake.kv_usage_milli.store(990, Ordering::SeqCst);
    let st = g.wait_state(|s| s["ladder"]["level"] == "reject_new").await;
    assert_eq!(st["ladder"]["cause"], "kv_usage");
    let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "guard_reject_new");
    let ra: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&ra));
    let m = g.metrics().await;
    assert_eq!(sample(&m, "envelope_governor_ladder_state"), Some(2.0));
    // Recovery, one step at a time.
    g.fake.kv_usage_milli.store(100, Ordering::SeqCst);
    g.wait_state(|s| s["ladder"]["level"] == "normal").await;
    let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(r.status(), 200);
}

/// Metrics that worked and then went away are stale: unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_that_go_stale_count_as_unhealthy() {
    let g = start(limits(1000, 100, 4, 4000), |s| {
        s.ladder.stale_ms = 100;
        s.ladder.reject_stale_ms = 400;
    })
    .await;
    let _task = live_guard::spawn_guard(
        g.gov.clone(),
        format!("{}/metrics", g.upstream),
        Duration::from_millis(50),
        true,
    );
    g.fake.kv_usage_milli.store(500, Ordering::SeqCst);
    g.wait_state(|s| s["ladder"]["level"] == "normal").await;
    // One good reading is enough to know the endpoint exists.
    while sample(&g.metrics().await, "envelope_governor_upstream_kv_usage") != Some(0.5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    g.fake.no_metrics.store(true, Ordering::SeqCst);
    let st = g.wait_state(|s| s["ladder"]["level"] == "reject_new").await;
    assert_eq!(st["ladder"]["cause"], "stale_readings", "{st}");
    assert_eq!(g.gov.level(), Level::RejectNew);
    let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
    assert_eq!(r.status(), 429);
}

/// A server without Prometheus metrics (404 from the start, or nothing
/// listening) does not tighten admission: the guard runs without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_absent_from_the_start_do_not_tighten() {
    for unreachable in [false, true] {
        let g = start(limits(1000, 100, 4, 4000), |s| {
            s.ladder.stale_ms = 100;
            s.ladder.reject_stale_ms = 400;
        })
        .await;
        g.fake.no_metrics.store(true, Ordering::SeqCst);
        let url = if unreachable {
            "http://127.0.0.1:9/metrics".to_string()
        } else {
            format!("{}/metrics", g.upstream)
        };
        let _task = live_guard::spawn_guard(g.gov.clone(), url, Duration::from_millis(50), true);
        // Well past both staleness limits, every request is served.
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let r = g.post("/v1/completions", json!({"prompt": "hi"})).await;
            assert_eq!(r.status(), 200);
            assert_eq!(r.headers()["x-envelope-max-tokens"], "100");
        }
        assert_eq!(g.gov.level(), Level::Normal);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn a_tenant_at_its_ceiling_does_not_block_another() {
    let tenants = TenantsSettings::from_toml(
        r#"
        [tenants.hog]
        burst = 0.5
        api_keys = ["sk-hog"]
        [tenants.calm]
        guaranteed = 0.5
        api_keys = ["sk-calm"]
        "#,
        "t.toml",
    )
    .unwrap();
    // 4 sequences; hog may use 2.
    let g = start(limits(1000, 10, 4, 4000), move |s| s.tenants = tenants).await;
    // hog's first two run 10 x 100 ms: time for its other two to queue and
    // for calm to come in while they wait.
    g.fake.delay_per_token_ms.store(100, Ordering::SeqCst);
    let mut hogs = vec![];
    for _ in 0..4 {
        let c = g.client.clone();
        let url = g.url("/v1/completions");
        hogs.push(tokio::spawn(async move {
            c.post(url)
                .bearer_auth("sk-hog")
                .json(&json!({"prompt": "a", "max_tokens": 10}))
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    let st = g.wait_state(|s| s["queue"]["requests"] == 2).await;
    assert_eq!(st["in_flight"]["sequences"], 2, "{st}");
    // calm gets in at once although hog's requests are queued ahead.
    let r = g
        .client
        .post(g.url("/v1/completions"))
        .bearer_auth("sk-calm")
        .json(&json!({"prompt": "b", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-envelope-queue-ms"], "0");
    assert_eq!(r.headers()["x-envelope-tenant"], "calm");
    for h in hogs {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert!(g.fake.max_seqs_in_flight.load(Ordering::SeqCst) <= 3);
}

/// A whole answer of known length (the fake's JSON has a Content-Length,
/// as vLLM's, TGI's and llama.cpp's do) is settled when its last byte goes
/// out: its time reaches the latency guard and its `usage` is booked.
/// hyper ends such an answer on its last byte and drops the body without
/// asking for more, so a relay that settled only at the body's end never
/// did (the guard saw no sample from a non-streaming answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_whole_answer_reaches_the_latency_guard_and_is_settled() {
    let g = start(limits(1000, 10, 4, 4000), |s| {
        // An e2e SLO far above these answers' time: the guard watches.
        s.latency.e2e_slo_ms = Some(60_000.0);
    })
    .await;
    for _ in 0..3 {
        let r = g
            .post(
                "/v1/completions",
                json!({"prompt": "abcdefg", "max_tokens": 2}),
            )
            .await;
        assert_eq!(r.status(), 200);
        assert!(r.headers().get("content-length").is_some());
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 2);
    }
    let s = g
        .wait_state(|s| s["latency_guard"]["observed"]["samples"].as_u64() >= Some(3))
        .await;
    assert_eq!(s["latency_guard"]["observed"]["samples"], 3, "{s}");
    assert!(
        s["latency_guard"]["observed"]["e2e_p95_ms"].is_number(),
        "{s}"
    );
    // Each answer's usage: its prompt as the fake counts it (7 bytes) and
    // the 2 tokens it generated.
    let m = g.metrics().await;
    assert_eq!(
        sample(&m, "envelope_governor_used_tokens_settled_total"),
        Some(3.0 * (7.0 + 2.0)),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn estimate_is_labelled_in_headers_and_metrics() {
    let (fake, upstream) = fake_upstream().await;
    let g = start_with(
        fake,
        upstream,
        limits(1000, 10, 4, 4000),
        |_| {},
        Some(TokenCounter::Estimate {
            bytes_per_token: 3.0,
        }),
    )
    .await;
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": "abcdefg", "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.headers()["x-envelope-token-count"], "estimate");
    // 7 bytes / 3, rounded up, and the 2 special tokens a tokenizer may add.
    assert_eq!(r.headers()["x-envelope-prompt-tokens"], "5");
    let m = g.metrics().await;
    assert!(
        m.contains("envelope_governor_token_counts_total{source=\"estimate\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("envelope_governor_profile{profile_id=\"test-profile\"} 1"),
        "{m}"
    );
    for name in [
        "envelope_governor_in_flight_sequences",
        "envelope_governor_queued_requests",
        "envelope_governor_queued_tokens",
        "envelope_governor_reserved_kv_tokens",
        "envelope_governor_kv_headroom_tokens",
        "envelope_governor_ladder_state",
        "envelope_governor_added_latency_seconds_count",
    ] {
        assert!(sample(&m, name).is_some(), "{name} missing:\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_needs_loopback_or_token_and_reload_swaps_limits() {
    let g = start(limits(1000, 10, 4, 4000), |s| {
        s.admin_token = Some("sesame".into())
    })
    .await;
    // Loopback (the test client) may read the state.
    let st: Value = g.state().await;
    assert_eq!(st["limits"]["max_output_tokens"], 10);
    // In process without a peer address (no loopback proof), only the token works.
    let state = std::sync::Arc::new(envelope_governor::GovernedUpstream::new(
        g.gov.clone(),
        &g.upstream,
        TokenCounter::Estimate {
            bytes_per_token: 3.0,
        },
    ));
    use tower::ServiceExt;
    let app = envelope_governor::app(state.clone());
    let req = axum::http::Request::get("/admin/state")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(app.clone().oneshot(req).await.unwrap().status(), 403);
    let req = axum::http::Request::get("/admin/state")
        .header("x-envelope-admin-token", "sesame")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(app.oneshot(req).await.unwrap().status(), 200);
    // Reload: valid settings apply; invalid ones cannot be made, so the
    // old stay.
    let mut s = g.gov.settings().draft();
    s.limits.max_output_tokens = 7;
    g.gov.reload(s.check().unwrap());
    let r = g.post("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(r.headers()["x-envelope-max-tokens"], "7");
    let mut bad = g.gov.settings().draft();
    bad.limits.max_concurrent_seqs = 0;
    assert!(bad.check().is_err());
    assert_eq!(g.gov.limits().max_concurrent_seqs, 4);
}
