//! Prompt and output tokens hidden in fields the governor did not read:
//! every one is counted or bounded.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tools_tool_calls_and_media_parts_are_counted() {
    // The fake's /tokenize counts message contents only, one token a byte.
    let g = start(limits(300, 10, 4, 4000), |s| {
        s.counting.image_part_tokens = 500
    })
    .await;
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
