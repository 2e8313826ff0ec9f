//! The profile's parse, validation and migration.

use super::*;

fn sample() -> Profile {
    Profile {
        schema: PROFILE_SCHEMA.into(),
        created_unix_ms: 1,
        fingerprint: serde_json::json!({"schema": 1}),
        slo: Slo::default(),
        configs: vec![],
        selected: "x".into(),
        limits: Some(Limits {
            max_context_tokens: 2048,
            max_output_tokens: 512,
            max_concurrent_seqs: 8,
            max_kv_tokens_in_flight: 8192,
            buckets: vec![],
        }),
        no_safe_point: None,
        probes_total: 0,
        quality: None,
        load: None,
    }
}

fn bucket(input: u32, output: u32, safe: u32, probes: &[(u32, f64)]) -> BucketResult {
    let probes: Vec<ProbeSummary> = probes
        .iter()
        .map(|&(c, ttft)| ProbeSummary {
            concurrency: c,
            ttft_ms: Percentiles {
                p95: ttft,
                ..Default::default()
            },
            output_tok_per_s: 10.0 * c as f64,
            valid: true,
            ..Default::default()
        })
        .collect();
    BucketResult {
        input_tokens: input,
        output_tokens: output,
        feasible_concurrency: safe + 1,
        infeasible_concurrency: None,
        safe_concurrency: safe,
        binding_constraint: Constraint::TtftP95,
        knee_concurrency: None,
        at_feasible: probes.last().cloned(),
        feasible_rate_per_s: None,
        safe_rate_per_s: None,
        feasible_upper: None,
        safe_upper: None,
        cached_prefix: None,
        repeats: vec![],
        probes,
    }
}

fn config(buckets: Vec<BucketResult>) -> ConfigResult {
    ConfigResult {
        name: "x".into(),
        precision: "q4_1".into(),
        kv_dtype: "f16".into(),
        batch_policy: "continuous".into(),
        max_num_seqs: 16,
        memory: MemoryReport::default(),
        backend: None,
        buckets,
        error: None,
        server_checks: None,
        time_to_ready_s: None,
        workload: None,
        trace: None,
    }
}

#[test]
fn the_table_comes_from_the_sweep_per_bucket() {
    let c = config(vec![
        bucket(
            256,
            32,
            4,
            &[(1, 100.0), (2, 150.0), (4, 300.0), (8, 900.0)],
        ),
        bucket(64, 32, 13, &[(1, 50.0), (8, 200.0), (16, 700.0)]),
    ]);
    let l = Limits::from_config(&c, 5000, 0.1);
    assert_eq!(l.max_concurrent_seqs, 13);
    assert_eq!((l.max_context_tokens, l.max_output_tokens), (288, 32));
    let labels: Vec<String> = l.buckets.iter().map(|b| b.label()).collect();
    assert_eq!(labels, ["64x32", "256x32"]);
    // Latency from the largest clean probe at or under the safe point.
    assert_eq!(l.buckets[0].measured_at_concurrency, Some(8));
    assert_eq!(l.buckets[0].ttft_p95_ms, Some(200.0));
    assert_eq!(l.buckets[1].ttft_p95_ms, Some(300.0));
    assert_eq!(l.buckets[1].kv_tokens, 4 * 288);
    // The smallest covering bucket; none past the largest.
    assert_eq!(l.bucket_for(97).unwrap().1.label(), "256x32");
    assert_eq!(l.bucket_for(96).unwrap().0, 0);
    assert_eq!(l.bucket_for(1).unwrap().0, 0);
    assert!(l.bucket_for(289).is_none());
}

#[test]
fn a_v1_profile_loads_with_its_table_rebuilt_from_the_sweep() {
    let mut p = sample();
    p.schema = PROFILE_SCHEMA_V1.into();
    p.limits = Some(Limits {
        max_context_tokens: 288,
        max_output_tokens: 32,
        max_concurrent_seqs: 4,
        max_kv_tokens_in_flight: 5000,
        buckets: vec![],
    });
    p.configs = vec![config(vec![
        bucket(64, 32, 13, &[(8, 200.0)]),
        bucket(256, 32, 4, &[(4, 300.0)]),
    ])];
    let mut v = serde_json::to_value(&p).unwrap();
    v["limits"].as_object_mut().unwrap().remove("buckets");
    let got = Profile::from_json(&v.to_string(), "old.json").unwrap();
    assert_eq!(got.limits.as_ref().unwrap().buckets.len(), 2);
    assert_eq!(got.limits.as_ref().unwrap().max_concurrent_seqs, 13);
    // Without the sweep's results: one row of the scalar limits.
    p.configs.clear();
    let mut v = serde_json::to_value(&p).unwrap();
    v["limits"].as_object_mut().unwrap().remove("buckets");
    let got = Profile::from_json(&v.to_string(), "old.json").unwrap();
    assert_eq!(got.limits.as_ref().unwrap().buckets.len(), 1);
    let row = &got.limits.as_ref().unwrap().buckets[0];
    assert_eq!((row.label(), row.safe_concurrency), ("256x32".into(), 4));
    assert_eq!(got.limits.as_ref().unwrap().max_concurrent_seqs, 4);
}

#[test]
fn committed_json_schema_is_current() {
    assert_committed_schema("profile.schema.json", &json_schema());
}

/// `profiles/schema/NAME` holds `schema` (written instead with
/// `ENVELOPE_WRITE_SCHEMA` set).
pub(crate) fn assert_committed_schema(name: &str, schema: &serde_json::Value) {
    let path = format!(
        "{}/../../profiles/schema/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let want = serde_json::to_string_pretty(schema).unwrap() + "\n";
    if std::env::var_os("ENVELOPE_WRITE_SCHEMA").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{path} is stale: run ENVELOPE_WRITE_SCHEMA=1 cargo test -p envelope-profile"
    );
}

#[test]
fn round_trips_and_validates() {
    let text = serde_json::to_string(&sample()).unwrap();
    let mut want = sample();
    let l = want.limits.as_mut().unwrap();
    l.buckets = vec![l.single_row()];
    let got = Profile::from_json(&text, "p.json").unwrap();
    assert_eq!(got, want);
    let again = serde_json::to_string(&got).unwrap();
    assert_eq!(Profile::from_json(&again, "p.json").unwrap(), want);
    let mut p = sample();
    p.limits.as_mut().unwrap().max_concurrent_seqs = 0;
    let e = Profile::from_json(&serde_json::to_string(&p).unwrap(), "p.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("p.json") && e.contains("limits.max_concurrent_seqs"),
        "{e}"
    );
    let mut p = sample();
    p.schema = "envelope.profile/v0".into();
    assert!(
        Profile::from_json(&serde_json::to_string(&p).unwrap(), "p.json")
            .unwrap_err()
            .to_string()
            .contains("schema")
    );
    assert!(Profile::from_json("{", "p.json").is_err());
    let mut p = sample();
    let l = p.limits.as_mut().unwrap();
    l.buckets = vec![l.single_row()];
    l.buckets[0].safe_concurrency = 0;
    let e = Profile::from_json(&serde_json::to_string(&p).unwrap(), "p.json")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("limits.buckets[0]") && e.contains("1536x512"),
        "{e}"
    );
    // No safe point: `limits: null` loads when the reason is given, and
    // cannot be enforced; a null without a reason is refused.
    let mut p = sample();
    p.limits = None;
    let e = Profile::from_json(&serde_json::to_string(&p).unwrap(), "p.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("no_safe_point"), "{e}");
    p.no_safe_point = Some("x: every probe breached ttft_p95".into());
    let text = serde_json::to_string(&p).unwrap();
    assert!(text.contains("\"limits\":null"), "{text}");
    let got = Profile::from_json(&text, "p.json").unwrap();
    let e = got.enforceable_limits().unwrap_err();
    assert!(e.contains("every probe breached ttft_p95"), "{e}");
    assert_eq!(Constraint::KvCache.as_str(), "kv_cache");
    assert_eq!(
        serde_json::to_string(&Constraint::ItlP95).unwrap(),
        "\"itl_p95\""
    );
}
