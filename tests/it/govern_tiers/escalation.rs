//! An invalid-JSON answer is retried a tier up, and both attempts are booked.

use super::*;

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
    // Held whole, the stream still went through the governor's relay, so
    // the tier up's governor took its time to the first chunk (and the
    // latency guard its sample) as for a stream passed straight on; the
    // calls before were not streams.
    let page = gov.metrics_page().await;
    let first_chunks = page
        .lines()
        .find(|l| {
            l.starts_with("envelope_governor_time_to_first_chunk_seconds_count{tier=\"large\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(first_chunks, Some(1.0), "{page}");
}
