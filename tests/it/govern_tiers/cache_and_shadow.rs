//! The cache answers deterministic calls only; shadow calls a tier up report agreement.

use super::*;

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
    let m = gov.metrics_page().await;
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
