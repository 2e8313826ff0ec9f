use super::*;
use crate::{
    BucketResult, Constraint, Limits, MemoryReport, Percentiles, ProbeSummary, QualityReport, Slo,
    PROFILE_SCHEMA,
};

fn fp(precision: &str, cpu: &str, sha: &str) -> serde_json::Value {
    serde_json::json!({
        "schema": 1,
        "engine": {"name": "envelope", "version": "0.1.0", "flags": ["sweep"]},
        "model": {"kind": "file", "name": "m.gguf", "sha256": sha, "size_bytes": 10},
        "node": {"source": "host", "gpus": [], "driver_version": null,
                 "host": {"cpu_model": cpu, "logical_cores": 2, "arch": "x86_64", "os": "linux", "mem_total_bytes": 1}},
        "precision": precision,
        "kv_dtype": "f32",
    })
}

fn probe(c: u32, decode: f64) -> ProbeSummary {
    let pc = |v: f64| Percentiles {
        p50: v,
        p95: v * 1.5,
        p99: v * 2.0,
        max: v * 2.0,
        mean: v,
    };
    ProbeSummary {
        concurrency: c,
        requests: 8,
        valid: true,
        decode_tok_per_s: decode,
        prefill_tok_per_s: decode * 5.0,
        output_tok_per_s: decode,
        ttft_ms: pc(100.0),
        itl_ms: pc(10.0),
        e2e_ms: pc(1000.0),
        ..Default::default()
    }
}

fn profile(precision: &str, safe: u32, decode: f64, kl: f64, top1: f64) -> Profile {
    let bucket = |i, o| BucketResult {
        input_tokens: i,
        output_tokens: o,
        feasible_concurrency: safe + 1,
        infeasible_concurrency: None,
        safe_concurrency: safe,
        binding_constraint: Constraint::ItlP95,
        knee_concurrency: None,
        at_feasible: Some(probe(safe + 1, decode * 1.1)),
        feasible_rate_per_s: None,
        safe_rate_per_s: None,
        feasible_upper: None,
        safe_upper: None,
        cached_prefix: None,
        repeats: vec![],
        probes: vec![probe(safe, decode), probe(safe + 1, decode * 1.1)],
    };
    Profile {
        schema: PROFILE_SCHEMA.into(),
        created_unix_ms: 1,
        fingerprint: fp(precision, "AMD EPYC", "abc"),
        slo: Slo::default(),
        configs: vec![ConfigResult {
            name: format!("{precision}-f32-continuous"),
            precision: precision.into(),
            kv_dtype: "f32".into(),
            batch_policy: "continuous".into(),
            max_num_seqs: 16,
            backend: None,
            memory: MemoryReport {
                weight_bytes: 1000,
                weight_bytes_analytic: 1000,
                kv_bytes_per_token: 10,
                kv_capacity_tokens: 5000,
                peak_bytes: Some(3000),
                ..Default::default()
            },
            buckets: vec![bucket(64, 32), bucket(128, 64)],
            error: None,
            server_checks: None,
            time_to_ready_s: None,
            workload: None,
            trace: None,
        }],
        selected: format!("{precision}-f32-continuous"),
        limits: Some(Limits {
            max_context_tokens: 192,
            max_output_tokens: 64,
            max_concurrent_seqs: 8,
            max_kv_tokens_in_flight: 1000,
            buckets: vec![],
        }),
        no_safe_point: None,
        probes_total: 4,
        load: None,
        quality: Some(QualityReport {
            model: "m.gguf".into(),
            precision: precision.into(),
            reference_precision: Some("f32".into()),
            text_set: "t.txt".into(),
            text_bytes: 100,
            window_tokens: 64,
            windows: 2,
            tokens_scored: 126,
            perplexity: 10.0,
            mean_nll_nats: 10f64.ln(),
            reference_perplexity: Some(10.0),
            kl_divergence_mean: Some(kl),
            kl_divergence_p95: Some(kl * 3.0),
            top1_agreement: Some(top1),
            duration_s: 1.0,
        }),
    }
}

#[test]
fn rules_parse_and_name_the_field() {
    let r = Rule::parse("decode_tok_s >= 0.95 x baseline").unwrap();
    assert_eq!(
        (r.op, r.number, r.relative_to_baseline),
        (Op::Ge, 0.95, true)
    );
    let r = Rule::parse("kl_divergence <= 0.02").unwrap();
    assert!(!r.relative_to_baseline);
    assert!(Rule::parse("nonsense <= 1")
        .unwrap_err()
        .contains("unknown metric"));
    assert!(Rule::parse("kl_divergence == 1")
        .unwrap_err()
        .contains("operator"));
    assert!(Rule::parse("kl_divergence <= lots")
        .unwrap_err()
        .contains("not a number"));
    assert!(Rule::parse("kl_divergence <= 1 x reference").is_err());
    let e = GateRules::from_toml("rules = [\"top1_agreement >= 0.9\", \"x <= 1\"]", "g.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("g.toml") && e.contains("rules[1]"), "{e}");
    let e = GateRules::from_toml("rulez = []", "g.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("g.toml") && e.contains("rulez"), "{e}");
    assert_eq!(GateRules::default_rules().rules.len(), 4);
}

#[test]
fn rule_evaluation() {
    let rel = Rule::parse("decode_tok_s >= 0.95 x baseline").unwrap();
    let (t, s) = evaluate(&rel, Some(100.0), Some(95.0));
    assert!((t.unwrap() - 95.0).abs() < 1e-9);
    assert_eq!(s, RuleStatus::Pass);
    assert_eq!(evaluate(&rel, Some(100.0), Some(94.9)).1, RuleStatus::Fail);
    assert_eq!(evaluate(&rel, None, Some(94.9)).1, RuleStatus::Missing);
    let abs = Rule::parse("kl_divergence <= 0.02").unwrap();
    assert_eq!(evaluate(&abs, None, Some(0.02)).1, RuleStatus::Pass);
    assert_eq!(evaluate(&abs, None, Some(0.021)).1, RuleStatus::Fail);
    assert_eq!(evaluate(&abs, None, None).1, RuleStatus::Missing);
    assert_eq!(evaluate(&abs, None, Some(f64::NAN)).1, RuleStatus::Missing);
    let lt = Rule::parse("ttft_p95_ms < 1.1 x baseline").unwrap();
    assert_eq!(evaluate(&lt, Some(100.0), Some(111.0)).1, RuleStatus::Fail);
    assert_eq!(evaluate(&lt, Some(100.0), Some(109.0)).1, RuleStatus::Pass);
}

#[test]
fn a_better_candidate_passes_per_bucket() {
    let a = profile("f16", 4, 100.0, 0.0, 1.0);
    let b = profile("q8_0", 5, 98.0, 0.001, 0.99);
    let r = gate(&a, &b, &GateRules::default_rules());
    assert!(r.comparable, "{:?}", r.unusable_reasons);
    assert_eq!(r.verdict, Verdict::Pass);
    // 2 bucket rules x 2 buckets + 2 quality rules.
    assert_eq!(r.rules.len(), 6);
    let d = r
        .rules
        .iter()
        .find(|x| x.rule.starts_with("decode") && x.bucket.as_deref() == Some("128x64"))
        .unwrap();
    // The probe at the safe concurrency is used, unscaled.
    assert_eq!((d.baseline, d.candidate), (Some(100.0), Some(98.0)));
    assert!((d.threshold.unwrap() - 95.0).abs() < 1e-9);
    // Only precision differs, and it is expected.
    assert!(
        r.differences.iter().all(|d| d.kind == "expected"),
        "{:?}",
        r.differences
    );
    assert!(r.differences.iter().any(|d| d.field == "precision"));
    // Another backend is reported with both values, as a note.
    let mut on_kernels = b.clone();
    on_kernels.configs[0].backend = Some("cuda:0 H200; GEMMs: kernels".into());
    let mut on_cublas = a.clone();
    on_cublas.configs[0].backend = Some("cuda:0 H200; GEMMs: cublas".into());
    let rb = gate(&on_cublas, &on_kernels, &GateRules::default_rules());
    let d = rb
        .differences
        .iter()
        .find(|d| d.field == "config.backend")
        .expect("a backend difference");
    assert_eq!(d.kind, "note");
    assert_eq!(d.candidate, "cuda:0 H200; GEMMs: kernels");
    assert!(!r.differences.iter().any(|d| d.field == "config.backend"));
    let md = markdown(&r);
    assert!(
        md.contains("# Gate: PASS") && md.contains("## Bucket 64x32"),
        "{md}"
    );
    assert_eq!(r.verdict.exit_code(), 0);
}

#[test]
fn a_worse_candidate_fails_with_the_measured_values() {
    let a = profile("f16", 4, 100.0, 0.0, 1.0);
    let b = profile("q4_0", 3, 90.0, 0.05, 0.9);
    let r = gate(&a, &b, &GateRules::default_rules());
    assert_eq!(r.verdict, Verdict::Fail);
    assert_eq!(r.verdict.exit_code(), 1);
    let failed: Vec<_> = r
        .rules
        .iter()
        .filter(|x| x.status != RuleStatus::Pass)
        .collect();
    assert_eq!(failed.len(), 6);
    let kl = r.rules.iter().find(|x| x.rule.starts_with("kl")).unwrap();
    assert_eq!((kl.candidate, kl.threshold), (Some(0.05), Some(0.02)));
    assert!(markdown(&r).contains("**FAIL**"));
    // No quality section on the candidate: the quality rules are failures, said as such.
    let mut c = profile("q8_0", 5, 100.0, 0.0, 1.0);
    c.quality = None;
    let r = gate(&a, &c, &GateRules::default_rules());
    assert_eq!(r.verdict, Verdict::Fail);
    assert!(r.rules.iter().any(|x| x.status == RuleStatus::Missing));
    assert!(markdown(&r).contains("not measured"));
}

#[test]
fn incomparable_profiles_are_unusable_and_say_why() {
    let a = profile("f16", 4, 100.0, 0.0, 1.0);
    // Another model.
    let mut b = profile("q8_0", 4, 100.0, 0.0, 1.0);
    b.fingerprint = fp("q8_0", "AMD EPYC", "def");
    let r = gate(&a, &b, &GateRules::default_rules());
    assert_eq!(r.verdict, Verdict::Unusable);
    assert_eq!(r.verdict.exit_code(), 2);
    assert!(
        r.unusable_reasons[0].contains("model.sha256"),
        "{:?}",
        r.unusable_reasons
    );
    // Another CPU: blocking, unless the rules allow it.
    let mut c = profile("q8_0", 4, 100.0, 0.0, 1.0);
    c.fingerprint = fp("q8_0", "Intel Xeon", "abc");
    let r = gate(&a, &c, &GateRules::default_rules());
    assert_eq!(r.verdict, Verdict::Unusable);
    assert!(r.unusable_reasons[0].contains("node.host.cpu_model"));
    let mut rules = GateRules::default_rules();
    rules.allow_differences = vec!["node.host.cpu_model".into()];
    let r = gate(&a, &c, &rules);
    assert_eq!(r.verdict, Verdict::Pass);
    assert!(r
        .differences
        .iter()
        .any(|d| d.field == "node.host.cpu_model" && d.kind == "note"));
    // Other buckets.
    let mut d = profile("q8_0", 4, 100.0, 0.0, 1.0);
    d.configs[0].buckets[1].input_tokens = 256;
    let r = gate(&a, &d, &GateRules::default_rules());
    assert_eq!(r.verdict, Verdict::Unusable);
    assert!(
        r.unusable_reasons[0].contains("buckets differ"),
        "{:?}",
        r.unusable_reasons
    );
    // A configuration that is not there.
    let mut rules = GateRules::default_rules();
    rules.candidate_config = Some("nope".into());
    let r = gate(&a, &b, &rules);
    assert!(r
        .unusable_reasons
        .iter()
        .any(|u| u.contains("candidate: no configuration `nope`")));
    // GPU model differs: blocking; a different card of the same model is a note.
    let gpu = |name: &str, uuid: &str| {
        let mut f = fp("f16", "AMD EPYC", "abc");
        f["node"]["gpus"] = serde_json::json!([{"index": 0, "name": name, "uuid_hash": uuid}]);
        f
    };
    let diffs = fingerprint_differences(&gpu("H100", "a"), &gpu("H200", "b"), &[]);
    let kind = |f: &str| diffs.iter().find(|d| d.field == f).map(|d| d.kind.clone());
    assert_eq!(kind("node.gpus.0.name").as_deref(), Some("blocking"));
    assert_eq!(kind("node.gpus.0.uuid_hash").as_deref(), Some("note"));
}

/// Each bucket's repeats: one search a value, its probe at the safe
/// concurrency with that decode rate.
fn with_repeats(mut p: Profile, decode: &[f64]) -> Profile {
    for b in &mut p.configs[0].buckets {
        b.repeats = decode
            .iter()
            .map(|&d| crate::BucketRepeat {
                feasible_concurrency: b.feasible_concurrency,
                safe_concurrency: b.safe_concurrency,
                probes: vec![probe(b.safe_concurrency, d)],
            })
            .collect();
    }
    p
}

/// `n` decode rates, lognormal with CV 8% around `mean`.
fn drift(rng: &mut rand::rngs::StdRng, mean: f64, n: usize) -> Vec<f64> {
    use rand_distr::Distribution;
    let sigma = (1.0f64 + 0.08 * 0.08).ln().sqrt();
    let d = rand_distr::LogNormal::new(mean.ln() - sigma * sigma / 2.0, sigma).unwrap();
    (0..n).map(|_| d.sample(rng)).collect()
}

fn decode_rule() -> GateRules {
    GateRules::from_toml(r#"rules = ["decode_tok_s >= 0.95 x baseline"]"#, "t.toml").unwrap()
}

/// Exit codes of 100 seeded gates of a baseline at 100 tok/s against a
/// candidate at `mean`, `n` repeats a side.
fn exits(mean: f64, n: usize) -> [usize; 4] {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut out = [0; 4];
    for _ in 0..100 {
        let a = with_repeats(
            profile("f16", 4, 100.0, 0.0, 1.0),
            &drift(&mut rng, 100.0, n),
        );
        let b = with_repeats(
            profile("q8_0", 4, 100.0, 0.0, 1.0),
            &drift(&mut rng, mean, n),
        );
        out[gate(&a, &b, &decode_rule()).verdict.exit_code() as usize] += 1;
    }
    out
}

#[test]
fn per_repeat_figures_tell_drift_from_a_regression() {
    let n = crate::confidence::GATE_REPEATS;
    let same = exits(100.0, n);
    assert!(same[0] >= 95, "unchanged, exits 0/1/2/3: {same:?}");
    let slower = exits(85.0, n);
    assert!(slower[1] >= 95, "15% slower, exits 0/1/2/3: {slower:?}");
}

#[test]
fn one_repeat_within_the_noise_floor_is_inconclusive() {
    let a = with_repeats(profile("f16", 4, 100.0, 0.0, 1.0), &[100.0]);
    let b = with_repeats(profile("q8_0", 4, 100.0, 0.0, 1.0), &[93.0]);
    let r = gate(&a, &b, &decode_rule());
    assert_eq!(
        (r.verdict, r.verdict.exit_code()),
        (Verdict::Inconclusive, 3)
    );
    assert!(
        r.rules.iter().all(|x| x.method == "noise_floor"),
        "{:?}",
        r.rules
    );
    let md = markdown(&r);
    assert!(md.contains("# Gate: INCONCLUSIVE"), "{md}");
    assert!(md.contains("repeats a side would decide it"), "{md}");
    // Past the noise floor it is decided, either way.
    let c = with_repeats(profile("q8_0", 4, 100.0, 0.0, 1.0), &[70.0]);
    assert_eq!(gate(&a, &c, &decode_rule()).verdict, Verdict::Fail);
    // Without repeats on one side: the point rule, as before.
    let d = profile("q8_0", 4, 93.0, 0.0, 1.0);
    let r = gate(&a, &d, &decode_rule());
    assert_eq!(r.verdict, Verdict::Fail);
    assert!(r.rules.iter().all(|x| x.method == "point"));
}

#[test]
fn the_rules_file_sets_the_confidence_and_the_noise_floor() {
    let r = GateRules::from_toml(
        "rules = [\"decode_tok_s >= 0.95 x baseline\"]\nconfidence = 0.99\nnoise_floor = 0.05",
        "t.toml",
    )
    .unwrap();
    assert_eq!((r.confidence, r.noise_floor), (0.99, 0.05));
    let d = GateRules::default_rules();
    assert_eq!((d.confidence, d.noise_floor), (0.9, 0.1));
    for (field, bad) in [
        ("confidence", "1.0"),
        ("confidence", "0.2"),
        ("noise_floor", "-0.1"),
    ] {
        let e = GateRules::from_toml(
            &format!("rules = [\"decode_tok_s >= 1\"]\n{field} = {bad}"),
            "t.toml",
        )
        .unwrap_err();
        assert!(e.to_string().contains(&format!("field `{field}`")), "{e}");
    }
}

#[test]
fn a_repeat_without_a_probe_at_or_above_the_safe_point_scales_the_one_below() {
    // A repeat that probed only below its safe point (safe 4, a probe at
    // 2): its rates scaled by 4 / 2, as a single search's safe point is.
    let below_only = |mut p: Profile, decode: f64, at: u32| {
        for b in &mut p.configs[0].buckets {
            b.repeats = (0..3)
                .map(|_| crate::BucketRepeat {
                    feasible_concurrency: 4,
                    safe_concurrency: 4,
                    probes: vec![probe(at, decode)],
                })
                .collect();
        }
        p
    };
    let a = below_only(profile("f16", 4, 100.0, 0.0, 1.0), 100.0, 2);
    let b = below_only(profile("q8_0", 4, 100.0, 0.0, 1.0), 80.0, 2);
    let r = gate(&a, &b, &decode_rule());
    assert_eq!(r.verdict, Verdict::Fail, "{:?}", r.rules);
    let x = &r.rules[0];
    assert_eq!((x.method, x.repeats), ("interval", Some((3, 3))));
    assert!((x.ratio.unwrap() - 0.8 / 0.95).abs() < 1e-9, "{x:?}");
    // Probed only above the safe point: no figure, the point rule.
    let c = below_only(profile("q8_0", 4, 100.0, 0.0, 1.0), 80.0, 6);
    assert!(gate(&a, &c, &decode_rule())
        .rules
        .iter()
        .all(|x| x.method == "point"));
}

#[test]
fn a_repeat_figure_between_two_probes_is_on_the_line() {
    // Probes at 2 (decode 80) and 6 (decode 120): at 4, 100.
    let between = |mut p: Profile, scale: f64| {
        for b in &mut p.configs[0].buckets {
            b.safe_concurrency = 4;
            b.repeats = (0..3)
                .map(|_| crate::BucketRepeat {
                    feasible_concurrency: 6,
                    safe_concurrency: 4,
                    probes: vec![probe(2, 80.0 * scale), probe(6, 120.0 * scale)],
                })
                .collect();
        }
        p
    };
    let a = between(profile("f16", 4, 100.0, 0.0, 1.0), 1.0);
    let b = between(profile("q8_0", 4, 100.0, 0.0, 1.0), 0.9);
    let r = gate(&a, &b, &decode_rule());
    let x = &r.rules[0];
    assert_eq!(x.method, "interval", "{x:?}");
    // 90 against 100: the candidate at 0.9 / 0.95 of the threshold.
    assert!((x.ratio.unwrap() - 0.9 / 0.95).abs() < 1e-9, "{x:?}");
}

/// A profile whose buckets' safe points were decided within
/// [safe, safe_upper] (`None`: no breach above was decided).
fn decided(mut p: Profile, safe: u32, upper: Option<u32>) -> Profile {
    for b in &mut p.configs[0].buckets {
        b.safe_concurrency = safe;
        b.feasible_upper = upper.map(|u| u as f64 + 1.0);
        b.safe_upper = upper.map(f64::from);
        b.probes[0].slo_checks = vec![crate::SloCheck {
            slo: Constraint::TtftP95,
            limit_ms: 1000.0,
            percentile: 0.95,
            samples: 45,
            over: 0,
            over_share_lower: 0.0,
            over_share_upper: 0.05,
            decision: crate::confidence::Decision::Holds,
        }];
    }
    p
}

#[test]
fn one_decided_search_a_side_compares_the_safe_intervals() {
    let rules =
        GateRules::from_toml("rules = [\"safe_concurrency >= 1.0 x baseline\"]", "r.toml").unwrap();
    let run = |b: Profile, c: Profile| {
        let r = gate(&b, &c, &rules);
        let x = r
            .rules
            .iter()
            .find(|x| x.bucket.as_deref() == Some("64x32"))
            .unwrap()
            .clone();
        (r.verdict, x)
    };
    let base = |safe, upper| decided(profile("f32", 4, 100.0, 0.0, 1.0), safe, upper);
    let cand = |safe, upper| decided(profile("q8_0", 4, 100.0, 0.01, 0.99), safe, upper);
    // The same interval a side: within the noise floor of the baseline's
    // upper end (13 >= 0.9 x 14), a pass.
    let (v, x) = run(base(13, Some(14)), cand(13, Some(14)));
    assert_eq!(
        (v, x.status, x.method),
        (Verdict::Pass, RuleStatus::Pass, "safe_interval")
    );
    let (lo, hi) = x.interval.unwrap();
    assert!(
        (lo - 13.0 / 14.0).abs() < 1e-9 && (hi - 14.0 / 13.0).abs() < 1e-9,
        "{x:?}"
    );
    // Even the candidate's upper end under the baseline's safe point: a fail.
    let (v, x) = run(base(13, Some(14)), cand(10, Some(11)));
    assert_eq!((v, x.status), (Verdict::Fail, RuleStatus::Fail));
    // Overlapping, one step down: cannot tell (12 < 0.9 x 14 = 12.6).
    let (v, x) = run(base(13, Some(14)), cand(12, Some(13)));
    assert_eq!(
        (v, x.status),
        (Verdict::Inconclusive, RuleStatus::Inconclusive)
    );
    // The baseline's upper end unknown: it can fail, never pass.
    let (_, x) = run(base(13, None), cand(13, Some(14)));
    assert_eq!(x.status, RuleStatus::Inconclusive);
    // The point rule without decided verdicts on a side, as before.
    let (_, x) = run(profile("f32", 4, 100.0, 0.0, 1.0), cand(13, Some(14)));
    assert_eq!(x.method, "point");
}
