//! Work the governor does before admission: a full queue refuses before
//! counting, and counting is one bounded call.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_refuses_before_counting() {
    let g = start(limits(1000, 10, 1, 4000), |s| s.queue.max_queue_len = 1).await;
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
        s.counting.count_timeout_ms = 400;
        s.counting.max_counting = 1;
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
    let g = start(limits(1000, 10, 4, 4000), |s| {
        s.counting.count_timeout_ms = 300
    })
    .await;
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
