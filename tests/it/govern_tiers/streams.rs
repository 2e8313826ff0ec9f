//! A streamed call whose upstream cannot be reached is retried a tier up
//! before any byte goes to the client, and the placement on the upstream
//! it never reached is given back.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_whose_upstream_is_down_goes_a_tier_up_before_any_byte() {
    let _one = SERIAL.lock().await;
    // A loopback port nothing listens on.
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let large = dummy(2, "tiny-large");
    let dir = temp_dir("stream-down");
    let text = format!(
        r#"
version = "v1"
order = ["small", "large"]
prices_version = "test-1"
[tiers.small]
upstreams = [{{ url = "{down}", profile = "{}", model = "tiny" }}]
price = {{ input_per_mtok = 100.0, output_per_mtok = 400.0 }}
[tiers.large]
upstreams = [{{ url = "{}", profile = "{}", model = "tiny-large" }}]
price = {{ input_per_mtok = 1000.0, output_per_mtok = 4000.0 }}
"#,
        profile(&dir, "small", 1024, 64, 8).display(),
        large.base,
        profile(&dir, "large", 1024, 64, 8).display(),
    );
    let path = dir.join("tiers.toml");
    std::fs::write(&path, &text).unwrap();
    // Counted by the estimate: the upstream that is down cannot count.
    let gov = common::Governor::launch(
        &dir,
        &[
            "--tiers",
            path.to_str().unwrap(),
            "--guard",
            "false",
            "--token-count",
            "estimate",
        ],
    );
    let mut body = ask("Say hi.", 8);
    body["stream"] = json!(true);
    let r = reqwest::Client::new()
        .post(gov.url("/v1/chat/completions"))
        .header("x-envelope-feature", "chat")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    assert_eq!(h["x-envelope-tier"], "large");
    assert_eq!(h["x-envelope-escalated"], "upstream_error");
    assert_eq!(h["x-envelope-escalated-from"], "small");
    assert!(h["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    assert!(
        text.contains("\"model\":\"tiny-large\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    let st = admin(&gov).await;
    // The attempt on the upstream that is down is booked (its prompt was
    // counted against it) with its escalation; the call, on the tier up.
    let s = row(&st, "chat", "small");
    assert_eq!(
        (
            s["attempts"].as_u64(),
            s["escalations"].as_u64(),
            s["calls"].as_u64(),
            s["output_tokens"].as_u64()
        ),
        (Some(1), Some(1), Some(0), Some(0))
    );
    let l = row(&st, "chat", "large");
    assert_eq!(
        (l["attempts"].as_u64(), l["calls"].as_u64()),
        (Some(1), Some(1))
    );
    // Nothing stays placed on either upstream: the send that failed gave
    // its placement back, the stream's ended with its body.
    for t in st["tiers"].as_array().unwrap() {
        let u = &t["upstreams"][0];
        assert_eq!(u["fullness"].as_f64(), Some(0.0), "{}: {u}", t["name"]);
    }
    // The tier up's governor timed the stream to its first chunk, as for
    // any stream it relays.
    let page = gov.metrics_page().await;
    let first_chunks = page
        .lines()
        .find(|l| {
            l.starts_with("envelope_governor_time_to_first_chunk_seconds_count{tier=\"large\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(first_chunks, Some(1.0), "{page}");
}
