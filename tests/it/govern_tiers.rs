//! `envelope govern --tiers` in front of real `envelope serve` upstreams as
//! model tiers (dummy presets with different seeds, and SmolLM2): routing
//! by each signal, escalation of an invalid-JSON answer, fallback from a
//! saturated tier before any 429, the cache for deterministic calls only,
//! shadow agreement, costs that add up to the tokens served, and reload
//! and rollback of the tiers file.

use crate::common;

use common::tiers::*;
use serde_json::{json, Value};
use std::time::Duration;

/// One test at a time: each starts its own servers, and two SmolLM2s on
/// two cores would only slow each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_invalid_json_answer_is_retried_a_tier_up_and_both_are_booked() {
    let _one = SERIAL.lock().await;
    let small = dummy(1, "tiny");
    let large = smollm2("smollm2");
    let dir = temp_dir("escalate");
    let text = format!(
        r#"
version = "v1"
order = ["small", "large"]
prices_version = "test-1"
[tiers.small]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny" }}]
price = {{ input_per_mtok = 100.0, output_per_mtok = 400.0 }}
[tiers.large]
upstreams = [{{ url = "{}", profile = "{}", model = "smollm2" }}]
price = {{ input_per_mtok = 1000.0, output_per_mtok = 4000.0 }}
[escalation]
streams = "buffer"
"#,
        small.base,
        profile(&dir, "small", 1024, 64, 8).display(),
        large.base,
        profile(&dir, "large", 1024, 64, 8).display(),
    );
    let gov = govern(&dir, &text);
    let mut body = ask("Give a JSON object with a key named a.", 12);
    body["response_format"] = json!({"type": "json_object"});
    let r = chat(&gov, body.clone(), &[("x-envelope-feature", "extract")]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.tier(), "large");
    assert_eq!(r.header("x-envelope-escalated"), "invalid_json");
    assert_eq!(r.header("x-envelope-escalated-from"), "small");
    assert_eq!(r.body["model"], "smollm2");
    let st = admin(&gov).await;
    let s = row(&st, "extract", "small");
    let l = row(&st, "extract", "large");
    assert_eq!(
        (
            s["attempts"].as_u64(),
            s["escalations"].as_u64(),
            s["calls"].as_u64()
        ),
        (Some(1), Some(1), Some(0))
    );
    assert_eq!(
        (l["attempts"].as_u64(), l["calls"].as_u64()),
        (Some(1), Some(1))
    );
    // Both attempts' tokens are counted, and the call's cost is both.
    assert_eq!(s["output_tokens"], 12);
    let (lp, lc) = r.usage();
    assert_eq!(
        (l["input_tokens"].as_u64(), l["output_tokens"].as_u64()),
        (Some(lp), Some(lc))
    );
    let cost = |row: &Value, i: f64, o: f64| {
        (row["input_tokens"].as_f64().unwrap() * i + row["output_tokens"].as_f64().unwrap() * o)
            / 1e6
    };
    let both = cost(s, 100.0, 400.0) + cost(l, 1000.0, 4000.0);
    let header: f64 = r.header("x-envelope-cost").parse().unwrap();
    assert!((header - both).abs() < 1e-9, "{header} vs {both}");
    // Without a JSON format the same cheap answer stands.
    let plain = chat(&gov, ask("Say hi.", 6), &[]).await;
    assert_eq!(
        (plain.tier(), plain.header("x-envelope-escalated")),
        ("small", "")
    );
    // A stream, held whole (`streams = "buffer"`), is checked the same way
    // and the client gets the tier up's stream.
    body["stream"] = json!(true);
    let r = reqwest::Client::new()
        .post(gov.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    assert_eq!(h["x-envelope-escalated"], "invalid_json");
    assert_eq!(h["x-envelope-tier"], "large");
    assert!(h["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    assert!(
        text.contains("\"model\":\"smollm2\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_saturated_tier_falls_back_before_any_429() {
    let _one = SERIAL.lock().await;
    let cheap = smollm2("smollm2");
    let strong = dummy(4, "tiny");
    let dir = temp_dir("fallback");
    let tiers = |fallback: &str| {
        format!(
            r#"
version = "v1"
order = ["cheap", "strong"]
{fallback}
[tiers.cheap]
upstreams = [{{ url = "{}", profile = "{}", model = "smollm2" }}]
[tiers.strong]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny" }}]
"#,
            cheap.base,
            profile(&dir, "cheap", 1024, 256, 1).display(),
            strong.base,
            profile(&dir, "strong", 1024, 256, 8).display(),
        )
    };
    // `cheap` holds one sequence; a long stream takes it.
    let hold = |gov_url: String| async move {
        let body = json!({"model": "x", "messages": [{"role": "user", "content": "Count."}],
                          "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stream": true});
        let mut r = reqwest::Client::new()
            .post(format!("{gov_url}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-envelope-tier"], "cheap");
        let first = r.chunk().await.unwrap();
        assert!(first.is_some());
        r
    };
    let deadline = [("x-request-deadline-ms", "300")];
    for (fallback, want) in [("[fallback]\ncheap = [\"strong\"]", 200), ("", 429)] {
        let gov = govern(&dir, &tiers(fallback));
        let held = hold(gov.base.clone()).await;
        let r = chat(&gov, ask("hi", 4), &deadline).await;
        assert_eq!(r.status, want, "fallback `{fallback}`: {:?}", r.body);
        if want == 200 {
            assert_eq!(r.tier(), "strong");
            assert_eq!(r.header("x-envelope-fallback-from"), "cheap");
            assert_eq!(r.body["model"], "tiny");
            let m = reqwest::get(gov.url("/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            assert!(
                m.contains("envelope_tier_fallbacks_total{from=\"cheap\",to=\"strong\"} 1"),
                "{m}"
            );
            assert!(
                !m.contains("envelope_governor_rejections_total{"),
                "nothing refused: {m}"
            );
        }
        drop(held);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_deterministic_calls_are_answered_from_the_cache() {
    let _one = SERIAL.lock().await;
    let up = dummy(5, "tiny");
    let dir = temp_dir("cache");
    let text = format!(
        r#"
version = "v1"
order = ["small"]
[tiers.small]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny" }}]
[cache]
enabled = true
"#,
        up.base,
        profile(&dir, "small", 1024, 64, 8).display()
    );
    let gov = govern(&dir, &text);
    const SERVED: &str = "envelope:request_success_total";
    let greedy = ask("repeat me", 6);
    let first = chat(&gov, greedy.clone(), &[]).await;
    assert_eq!(first.header("x-envelope-cache"), "miss");
    let second = chat(&gov, greedy.clone(), &[]).await;
    assert_eq!(second.header("x-envelope-cache"), "hit");
    assert_eq!(second.body, first.body, "the same answer");
    // Sampling is never cached, marked or not.
    let mut sampled = greedy.clone();
    sampled["temperature"] = json!(0.8);
    for _ in 0..2 {
        let r = chat(&gov, sampled.clone(), &[("x-envelope-cacheable", "true")]).await;
        assert_eq!(r.header("x-envelope-cache"), "off");
    }
    // No temperature: cacheable only when marked.
    let mut unset = greedy.clone();
    unset.as_object_mut().unwrap().remove("temperature");
    unset["messages"][0]["content"] = json!("another");
    assert_eq!(
        chat(&gov, unset.clone(), &[])
            .await
            .header("x-envelope-cache"),
        "off"
    );
    chat(&gov, unset.clone(), &[("x-envelope-cacheable", "1")]).await;
    let hit = chat(&gov, unset, &[("x-envelope-cacheable", "1")]).await;
    assert_eq!(hit.header("x-envelope-cache"), "hit");
    // Five calls reached the upstream (the two hits did not). Every call
    // above was answered before this line, and `envelope serve` counts a
    // success before its answer's last bytes: the count is final here,
    // with no wait (a wait of a while would miss a call later than it).
    assert_eq!(up.metric(SERVED).await, 5.0);
    let m = reqwest::get(gov.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("envelope_tier_cache_total{result=\"hit\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("envelope_tier_cache_total{result=\"miss\"} 2"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shadow_calls_report_agreement_with_the_tier_up() {
    let _one = SERIAL.lock().await;
    // small and standard run the same weights: they agree; large is
    // another model (SmolLM2): it does not.
    let (a, b, c) = (dummy(1, "tiny-a"), dummy(1, "tiny-b"), smollm2("tiny-c"));
    let dir = temp_dir("shadow");
    let extra = "[shadow]\nsample = 1.0\n[[rules]]\nname = \"hinted\"\ntier = \"standard\"\nhint = \"mid\"\n";
    let gov = govern(&dir, &three_tiers(&dir, &a, &b, &c, extra));
    for i in 0..3 {
        let r = chat(
            &gov,
            ask(&format!("question {i}"), 8),
            &[("x-envelope-feature", "qa")],
        )
        .await;
        assert_eq!(r.tier(), "small");
        let r = chat(
            &gov,
            ask(&format!("question {i}"), 8),
            &[
                ("x-envelope-feature", "qa"),
                ("x-envelope-tier-hint", "mid"),
            ],
        )
        .await;
        assert_eq!(r.tier(), "standard");
    }
    let find = |st: &Value, tier: &str| {
        st["shadow"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["tier"] == tier && s["feature"] == "qa")
            .cloned()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let st = loop {
        let st = admin(&gov).await;
        let done = |t| {
            find(&st, t).is_some_and(|s| {
                s["compared"].as_u64().unwrap() + s["skipped"].as_u64().unwrap() == 3
            })
        };
        if done("small") && done("standard") {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "shadows never finished: {st}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let small = find(&st, "small").unwrap();
    let standard = find(&st, "standard").unwrap();
    assert_eq!(small["reason"], "default");
    assert!(small["compared"].as_u64().unwrap() >= 1, "{st}");
    assert_eq!(
        small["agreed"], small["compared"],
        "same weights agree: {st}"
    );
    assert!(standard["compared"].as_u64().unwrap() >= 1, "{st}");
    assert_eq!(standard["agreed"], 0, "another model does not: {st}");
    // The shadows' spend is booked on the tier that served them.
    assert!(row(&st, "qa", "standard")["shadows"].as_u64().unwrap() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn costs_add_up_to_the_tokens_served() {
    let _one = SERIAL.lock().await;
    let (a, b) = (dummy(1, "tiny-a"), dummy(2, "tiny-b"));
    let dir = temp_dir("costs");
    let log = dir.join("calls.jsonl");
    let _ = std::fs::remove_file(&log);
    let text = format!(
        r#"
version = "v1"
order = ["small", "large"]
prices_version = "list-7"
[tiers.small]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-a" }}]
price = {{ input_per_mtok = 50.0, output_per_mtok = 200.0 }}
[tiers.large]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-b" }}]
price = {{ input_per_mtok = 500.0, output_per_mtok = 2000.0 }}
[[rules]]
name = "hinted"
tier = "large"
hint = "hard"
[features.summary]
max_cost_per_call = 0.001
[features.triage]
max_cost_per_call = 1.0
"#,
        a.base,
        profile(&dir, "small", 1024, 64, 8).display(),
        b.base,
        profile(&dir, "large", 1024, 64, 8).display(),
    );
    let path = dir.join("tiers.toml");
    std::fs::write(&path, &text).unwrap();
    let gov = common::Governor::launch(
        &dir,
        &[
            "--tiers",
            path.to_str().unwrap(),
            "--guard",
            "false",
            "--record",
            log.to_str().unwrap(),
        ],
    );
    let mut served = std::collections::HashMap::<(&str, String), (u64, u64, f64)>::new();
    for i in 0..8u64 {
        let (feature, hint) = if i % 4 == 3 {
            ("summary", "hard")
        } else {
            ("triage", "easy")
        };
        let r = chat(
            &gov,
            ask(&"x".repeat(10 + i as usize), 3 + i),
            &[
                ("x-envelope-feature", feature),
                ("x-envelope-tier-hint", hint),
            ],
        )
        .await;
        assert_eq!(r.status, 200);
        let (p, c) = r.usage();
        let e = served.entry((feature, r.tier().to_string())).or_default();
        e.0 += p;
        e.1 += c;
        e.2 += r.header("x-envelope-cost").parse::<f64>().unwrap();
    }
    let st = admin(&gov).await;
    let mut total = 0.0;
    for ((feature, tier), (p, c, cost)) in &served {
        let r = row(&st, feature, tier);
        assert_eq!(
            (
                r["input_tokens"].as_u64().unwrap(),
                r["output_tokens"].as_u64().unwrap()
            ),
            (*p, *c),
            "{feature} on {tier}"
        );
        let (pi, po) = if tier == "small" {
            (50.0, 200.0)
        } else {
            (500.0, 2000.0)
        };
        let want = (*p as f64 * pi + *c as f64 * po) / 1e6;
        assert!(
            (r["cost"].as_f64().unwrap() - want).abs() < 1e-12,
            "{feature} on {tier}"
        );
        assert!((cost - want).abs() < 1e-6, "headers: {cost} vs {want}");
        total += want;
    }
    // The one over its allowance is listed; the other is not.
    let over: Vec<&str> = st["over_budget"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["feature"].as_str().unwrap())
        .collect();
    assert_eq!(over, ["summary"]);
    // The record has a line per call (written off the request path, so
    // waited for), its costs the same total, its tokens what was served.
    let lines: Vec<Value> = common::lines_when(&log, 8)
        .await
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8);
    let logged: f64 = lines
        .iter()
        .map(|l| l["tiers"]["cost"].as_f64().unwrap())
        .sum();
    assert!((logged - total).abs() < 1e-9, "{logged} vs {total}");
    assert!(lines
        .iter()
        .all(|l| l["tiers"]["prices_version"] == "list-7" && l["tenant"] == "default"));
    let out: u64 = lines
        .iter()
        .map(|l| l["output_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(out, served.values().map(|v| v.1).sum::<u64>());
    // They are trace records, with no prompt text.
    let trace = envelope_profile::trace::Trace::read(log.to_str().unwrap(), None).unwrap();
    assert_eq!(trace.requests.len(), 8);
    assert!(!std::fs::read_to_string(&log)
        .unwrap()
        .contains("xxxxxxxxxx"));
    // The export and /metrics say the same.
    let csv = reqwest::get(gov.url("/admin/tiers/costs"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(csv.lines().count(), 1 + served.len(), "{csv}");
    let m = reqwest::get(gov.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("envelope_tier_feature_over_budget{feature=\"summary\"} 1"),
        "{m}"
    );
    let metric_cost: f64 = m
        .lines()
        .filter(|l| l.starts_with("envelope_tier_cost_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!(
        (metric_cost - total).abs() < 1e-9,
        "{metric_cost} vs {total}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tiers_file_reloads_refuses_bad_versions_and_rolls_back() {
    let _one = SERIAL.lock().await;
    let (a, b) = (dummy(1, "tiny-a"), dummy(2, "tiny-b"));
    let dir = temp_dir("reload");
    let file = |version: &str, tier: &str| {
        format!(
            r#"
version = "{version}"
order = ["small", "large"]
[tiers.small]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-a" }}]
[tiers.large]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-b" }}]
[[rules]]
name = "reports"
tier = "{tier}"
features = ["report"]
"#,
            a.base,
            profile(&dir, "small", 1024, 64, 8).display(),
            b.base,
            profile(&dir, "large", 1024, 64, 8).display(),
        )
    };
    let gov = govern(&dir, &file("v1", "small"));
    let report = [("x-envelope-feature", "report")];
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.tier(), r.header("x-envelope-tiers-version")),
        ("small", "v1")
    );
    // A model swap: only the mapping changes.
    let path = dir.join("tiers.toml");
    std::fs::write(&path, file("v2", "large")).unwrap();
    let (status, body) = post(&gov, "/admin/tiers/reload").await;
    assert_eq!(
        (status, body["version"].as_str()),
        (200, Some("v2")),
        "{body}"
    );
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.tier(), r.header("x-envelope-tiers-version")),
        ("large", "v2")
    );
    // An invalid version is refused with the file and field named; v2 stays.
    std::fs::write(&path, file("v3", "huge")).unwrap();
    let (status, body) = post(&gov, "/admin/tiers/reload").await;
    assert_eq!(status, 422, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("tiers.toml") && msg.contains("rules[0].tier"),
        "{msg}"
    );
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.status, r.header("x-envelope-tiers-version")),
        (200, "v2")
    );
    // Rollback restores v1.
    let (status, body) = post(&gov, "/admin/tiers/rollback").await;
    assert_eq!(
        (status, body["version"].as_str()),
        (200, Some("v1")),
        "{body}"
    );
    let r = chat(&gov, ask("hi", 2), &report).await;
    assert_eq!(
        (r.tier(), r.header("x-envelope-tiers-version")),
        ("small", "v1")
    );
    let (status, _) = post(&gov, "/admin/tiers/rollback").await;
    assert_eq!(status, 422, "nothing before v1");
}

#[test]
fn an_invalid_tiers_file_stops_the_start_naming_the_field() {
    let dir = temp_dir("invalid");
    let path = dir.join("tiers.toml");
    std::fs::write(
        &path,
        "version = \"v1\"\norder = [\"small\"]\n[tiers.small]\nupstreams = []\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["govern", "--tiers", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tiers.toml") && err.contains("tiers.small.upstreams"),
        "{err}"
    );
    let both = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args([
            "govern",
            "--tiers",
            path.to_str().unwrap(),
            "--upstream",
            "http://x",
        ])
        .output()
        .unwrap();
    assert!(!both.status.success());
}
