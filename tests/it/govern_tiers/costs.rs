//! Costs add up to the tokens served.

use super::*;

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
    let m = gov.metrics_page().await;
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
