//! Admission against the measured envelope: queue wait counted
//! against the TTFT budget (shed, or queue by configuration), and a request
//! beyond the largest measured bucket admitted alone when configured so.

use crate::common;

use common::*;
use envelope_governor::{Beyond, OverBudget};
use envelope_profile::{BucketLimit, Limits};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;

fn row(input: u64, output: u64, safe: u64) -> BucketLimit {
    BucketLimit {
        input_tokens: input,
        output_tokens: output,
        safe_concurrency: safe,
        concurrency_after_headroom: None,
        kv_tokens: safe * (input + output),
        ttft_p95_ms: None,
        itl_p95_ms: None,
        e2e_p99_ms: None,
        output_tok_per_s: None,
        request_per_s: None,
        measured_at_concurrency: None,
    }
}

/// One sequence at a time; a 100-token window of context.
fn one_seq() -> Limits {
    limits(1000, 100, 1, 4000)
}

/// `n` token ids: counted exactly, with no tokenizer.
fn prompt(n: usize) -> Value {
    json!((0..n as u64).collect::<Vec<_>>())
}

/// A request that holds the only sequence until the test ends (the fake
/// hangs), and the state once the governor has it in flight.
async fn hold_the_only_sequence(g: &Gov) -> tokio::task::JoinHandle<()> {
    g.fake.hang.store(true, Ordering::SeqCst);
    let (client, url) = (g.client.clone(), g.url("/v1/completions"));
    let held = tokio::spawn(async move {
        let _ = client
            .post(url)
            .json(&json!({"prompt": [1, 2], "max_tokens": 5}))
            .send()
            .await;
    });
    let st = g.wait_state(|s| s["in_flight"]["sequences"] == 1).await;
    assert_eq!(st["in_flight"]["sequences"], 1, "{st}");
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_request_gives_up_when_its_ttft_budget_is_spent() {
    let g = start(one_seq(), |s| {
        s.interactive_ttft_budget_ms = Some(300.0);
        s.over_budget = OverBudget::Shed;
    })
    .await;
    let held = hold_the_only_sequence(&g).await;
    // Queued behind a sequence that never ends: it cannot start within its
    // 300 ms budget, so it is refused once that is spent, as a temporary
    // overload with Retry-After, not held to the 60 s queue age.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": [3, 4], "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "ttft_budget");
    assert!(r.headers().contains_key("retry-after"));
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("TTFT budget"),
        "{v}"
    );
    assert_eq!(g.state().await["queue"]["requests"], 0);
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pickers_ttft_objective_tightens_the_budget_and_never_loosens_it() {
    let g = start(one_seq(), |s| {
        s.interactive_ttft_budget_ms = Some(1500.0);
        s.over_budget = OverBudget::Shed;
    })
    .await;
    let held = hold_the_only_sequence(&g).await;
    let ask = |header: &'static str, ms: &'static str| {
        let (client, url) = (g.client.clone(), g.url("/v1/completions"));
        async move {
            client
                .post(url)
                .header(header, ms)
                .json(&json!({"prompt": [3, 4], "max_tokens": 5}))
                .send()
                .await
                .unwrap()
        }
    };
    // What the refusal says the governor allowed: queued, the wait it
    // was given (the budget applied, less the TTFT it expects); refused
    // before queueing, the budget itself. The event, not the wall clock
    // of a loaded machine.
    let allowed = |v: &Value| -> u64 {
        let m = v["error"]["message"].as_str().unwrap_or_default();
        ["could wait ", "TTFT budget of "]
            .iter()
            .find_map(|key| m.split(key).nth(1)?.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no allowed wait in {v}"))
    };
    // The picker's 200 ms objective, under the class's 1.5 s: given up
    // within 200 ms, not 1.5 s.
    let r = ask("x-llm-d-slo-ttft-ms", "200").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "ttft_budget");
    let v: Value = r.json().await.unwrap();
    assert!((1..=200).contains(&allowed(&v)), "{v}");
    // Its older alias too.
    let r = ask("x-slo-ttft-ms", "200").await;
    assert_eq!(r.headers()["x-envelope-reason"], "ttft_budget");
    let v: Value = r.json().await.unwrap();
    assert!((1..=200).contains(&allowed(&v)), "{v}");
    // Asking for more than the class gets buys nothing: 1.5 s, not 60.
    let r = ask("x-llm-d-slo-ttft-ms", "60000").await;
    assert_eq!(r.headers()["x-envelope-reason"], "ttft_budget");
    let v: Value = r.json().await.unwrap();
    assert!((201..=1500).contains(&allowed(&v)), "{v}");
    // Not a number of milliseconds: 400, naming the header.
    for bad in ["soon", "0", "-5", "NaN"] {
        let r = ask("x-llm-d-slo-ttft-ms", bad).await;
        assert_eq!(r.status(), 400, "{bad}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("x-llm-d-slo-ttft-ms"),
            "{v}"
        );
    }
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_budget_queue_keeps_waiting_past_the_ttft_budget() {
    let g = start(one_seq(), |s| {
        s.interactive_ttft_budget_ms = Some(300.0);
        s.over_budget = OverBudget::Queue;
        s.queue.max_queue_age_ms = 1500;
    })
    .await;
    let held = hold_the_only_sequence(&g).await;
    // The budget does not bound the wait: the queue's own age limit does.
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": [3, 4], "max_tokens": 5}),
        )
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-envelope-reason"], "queue_timeout");
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn beyond_the_envelope_refused_or_admitted_alone() {
    let mut l = limits(1000, 100, 4, 4000);
    l.buckets = vec![row(48, 16, 4), row(200, 56, 2)];
    // By default: 400 naming the largest measured bucket.
    let g = start(l.clone(), |_| {}).await;
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": prompt(300), "max_tokens": 8}),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["x-envelope-reason"], "beyond_envelope");
    let v: Value = r.json().await.unwrap();
    // The code OpenAI clients know for "too long for this server".
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("200x56"),
        "{v}"
    );

    // Alone: it takes the whole envelope while it runs, so a short request
    // that would otherwise fit waits behind it.
    let g = start(l, |s| {
        s.beyond = Beyond::Alone;
        s.queue.max_queue_age_ms = 400;
    })
    .await;
    g.fake.hang.store(true, Ordering::SeqCst);
    let (client, url) = (g.client.clone(), g.url("/v1/completions"));
    let big = tokio::spawn(async move {
        client
            .post(url)
            .json(&json!({"prompt": (0..300u64).collect::<Vec<_>>(), "max_tokens": 8}))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    let st = g.wait_state(|s| s["in_flight"]["sequences"] == 1).await;
    assert_eq!(st["in_flight"]["envelope_share"], 1.0, "{st}");
    let beyond = st["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["bucket"] == "beyond")
        .cloned();
    assert_eq!(
        beyond.as_ref().map(|b| b["sequences"].clone()),
        Some(json!(1)),
        "{st}"
    );
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": prompt(8), "max_tokens": 8}),
        )
        .await;
    assert_eq!(
        r.status(),
        429,
        "a short request ran beside the one admitted alone"
    );
    big.abort();
    // Once it is gone the envelope is free again.
    g.fake.hang.store(false, Ordering::SeqCst);
    let st = g.wait_state(|s| s["in_flight"]["sequences"] == 0).await;
    assert_eq!(st["in_flight"]["sequences"], 0, "{st}");
    let r = g
        .post(
            "/v1/completions",
            json!({"prompt": prompt(8), "max_tokens": 8}),
        )
        .await;
    assert_eq!(r.status(), 200);
}
