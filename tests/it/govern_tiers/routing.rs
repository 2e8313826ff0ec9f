//! Each routing signal sends a call to its rule's tier.

use super::*;

/// (what, body, headers, tier, rule).
type Case<'a> = (&'a str, Value, Vec<(&'a str, &'a str)>, &'a str, &'a str);

const RULES: &str = r#"
[[rules]]
name = "long-prompt"
tier = "large"
prompt_tokens_over = 300
[[rules]]
name = "long-output"
tier = "standard"
max_tokens_over = 32
[[rules]]
name = "many-messages"
tier = "standard"
messages_over = 4
[[rules]]
name = "documents"
tier = "large"
documents_over = 0
[[rules]]
name = "tools"
tier = "standard"
tools = true
pin = true
[[rules]]
name = "json"
tier = "standard"
json = true
[[rules]]
name = "hinted"
tier = "large"
hint = "hard"
[[rules]]
name = "planner"
tier = "large"
features = ["planner"]
[[rules]]
name = "escalated-before"
tier = "standard"
escalated_before = true
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_signal_routes_a_call_to_its_rules_tier() {
    let _one = SERIAL.lock().await;
    let (a, b, c) = (dummy(1, "tiny-a"), dummy(2, "tiny-b"), dummy(3, "tiny-c"));
    let dir = temp_dir("signals");
    let gov = govern(&dir, &three_tiers(&dir, &a, &b, &c, RULES));
    let short = ask("hi", 4);
    let mut many = short.clone();
    many["messages"] = json!([
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"}
    ]);
    let mut doc = short.clone();
    doc["documents"] = json!([{"title": "a", "text": "read this"}]);
    let mut tools = short.clone();
    tools["tools"] = json!([{"type": "function", "function": {"name": "get", "parameters": {}}}]);
    let mut json_fmt = short.clone();
    json_fmt["response_format"] = json!({"type": "json_object"});
    let cases: Vec<Case> = vec![
        ("nothing", short.clone(), vec![], "small", "default"),
        (
            "prompt",
            ask(&"word ".repeat(80), 4),
            vec![],
            "large",
            "long-prompt",
        ),
        ("output", ask("hi", 40), vec![], "standard", "long-output"),
        ("messages", many, vec![], "standard", "many-messages"),
        ("documents", doc, vec![], "large", "documents"),
        ("tools", tools, vec![], "standard", "tools"),
        (
            "hint",
            short.clone(),
            vec![("x-envelope-tier-hint", "hard")],
            "large",
            "hinted",
        ),
        (
            "other hint",
            short.clone(),
            vec![("x-envelope-tier-hint", "easy")],
            "small",
            "default",
        ),
        (
            "feature",
            short.clone(),
            vec![("x-envelope-feature", "planner")],
            "large",
            "planner",
        ),
    ];
    let models = [
        ("small", "tiny-a"),
        ("standard", "tiny-b"),
        ("large", "tiny-c"),
    ];
    for (what, body, headers, tier, reason) in cases {
        let r = chat(&gov, body, &headers).await;
        assert_eq!(r.status, 200, "{what}: {:?}", r.body);
        assert_eq!((r.tier(), r.reason()), (tier, reason), "{what}");
        // The tier's upstream answered: its model name is in the answer.
        let model = models.iter().find(|m| m.0 == tier).unwrap().1;
        assert_eq!(r.body["model"], model, "{what}");
        assert_eq!(r.header("x-envelope-tiers-version"), "v1");
    }
    // The JSON rule sends a call to `standard`; its answer (random bytes)
    // is not JSON, so it is retried on `large`, and the conversation is
    // remembered as escalated.
    let r = chat(&gov, json_fmt, &[("x-envelope-conversation", "c-1")]).await;
    assert_eq!(r.reason(), "json");
    assert_eq!(r.tier(), "large");
    assert_eq!(r.header("x-envelope-escalated"), "invalid_json");
    let again = chat(&gov, short.clone(), &[("x-envelope-conversation", "c-1")]).await;
    assert_eq!(
        (again.tier(), again.reason()),
        ("standard", "escalated-before")
    );
    let other = chat(&gov, short.clone(), &[("x-envelope-conversation", "c-2")]).await;
    assert_eq!(other.tier(), "small");
    // A pinned tool step stays on its tier even when its answer fails.
    let mut pinned = short.clone();
    pinned["tools"] = json!([{"type": "function", "function": {"name": "get", "parameters": {}}}]);
    pinned["response_format"] = json!({"type": "json_object"});
    let r = chat(&gov, pinned, &[]).await;
    assert_eq!(
        (r.tier(), r.reason(), r.header("x-envelope-escalated")),
        ("standard", "tools", "")
    );
    // A feature name that is not one is a 400, not a silent default.
    let bad = chat(&gov, short, &[("x-envelope-feature", "no spaces allowed")]).await;
    assert_eq!(bad.status, 400, "{:?}", bad.body);
    assert_eq!(bad.body["error"]["type"], "invalid_request_error");
}
