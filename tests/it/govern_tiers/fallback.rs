//! A saturated tier falls back to another before any 429.

use super::*;

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
            let m = gov.metrics_page().await;
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
