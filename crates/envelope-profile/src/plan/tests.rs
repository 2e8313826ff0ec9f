//! The worked arithmetic of capacity planning, reproduced exactly,
//! and the supply/scenario logic on a synthetic profile.

use super::*;
use crate::workload::Workload;
use crate::{Limits, MemoryReport, Percentiles, ProbeSummary, Slo, PROFILE_SCHEMA};

fn close(got: f64, want: f64) {
    let tol = 1e-9 * want.abs().max(1.0);
    assert!((got - want).abs() <= tol, "got {got}, want {want}");
}

#[test]
fn seed_arithmetic_is_exact() {
    // 180 runs/min x 2.4 calls x 1.08 retry = 466.56 model requests/min.
    let req = model_requests_per_min(180.0, 2.4, 1.08, 1.0);
    close(req, 466.56);
    close(tokens_per_min(req, 7_200.0), 3_359_232.0);
    close(tokens_per_min(req, 1_200.0), 559_872.0);
    // 3 runs/s x 6 s = 18 in flight; 3 x 8 s = 24 peak slots.
    close(littles_law_in_flight(3.0, 6.0), 18.0);
    close(peak_scenario_slots(3.0, 8.0), 24.0);
    let r = Reserves {
        burst: 0.25,
        operational: 0.15,
        failover: 0.35,
    };
    close(provisioned_slots(24.0, &r), 42.0);
    assert_eq!(replicas_for(provisioned_slots(24.0, &r)), 42);
    // 120 runs/min x 2.2 x 1.06: 7,000 input and 1,100 output tokens a call.
    let req = model_requests_per_min(120.0, 2.2, 1.06, 1.0);
    close(tokens_per_min(req, 7_000.0), 1_958_880.0);
    close(tokens_per_min(req, 1_100.0), 307_824.0);
    // 200 x 2 x 1.08 retry x 1.03 fallback = 444.96 requests/min.
    close(model_requests_per_min(200.0, 2.0, 1.08, 1.03), 444.96);
}

const SEED: &str = r#"
name = "seed"
[reserves]
burst = 0.25
operational = 0.15
failover = 0.35
[scenarios]
failover_traffic_factor = 1.5
failover_retry_amplification = 1.2
recovery_backlog_factor = 2.0

[[class]]
name = "agent"
runs_per_min = 180
model_calls_per_run = 2.4
retry_amplification = 1.08
input_tokens_p50 = 7200
input_tokens_p95 = 7900
output_tokens_p50 = 1200
output_tokens_p95 = 1900
concurrency_basis = "run"
time_in_system_s_mean = 6
time_in_system_s_p95 = 8
dependencies_per_run = { vector_queries = 3, tool_writes = 0.5 }

[[class]]
name = "summarise"
runs_per_min = 120
model_calls_per_run = 2.2
retry_amplification = 1.06
input_tokens_p50 = 7000
input_tokens_p95 = 7800
output_tokens_p50 = 1100
output_tokens_p95 = 1500

[[class]]
name = "triage"
runs_per_min = 200
model_calls_per_run = 2
retry_amplification = 1.08
fallback_amplification = 1.03
input_tokens_p50 = 900
input_tokens_p95 = 1500
output_tokens_p50 = 200
output_tokens_p95 = 400
"#;

fn probe(
    c: u32,
    out_tok_s: f64,
    prefill_tok_s: f64,
    e2e_mean_ms: f64,
    e2e_p95_ms: f64,
) -> ProbeSummary {
    ProbeSummary {
        concurrency: c,
        requests: 10,
        valid: true,
        prefill_tok_per_s: prefill_tok_s,
        decode_tok_per_s: out_tok_s,
        output_tok_per_s: out_tok_s,
        e2e_ms: Percentiles {
            p50: e2e_mean_ms,
            p95: e2e_p95_ms,
            p99: e2e_p95_ms,
            max: e2e_p95_ms,
            mean: e2e_mean_ms,
        },
        ..Default::default()
    }
}

fn bucket(i: u32, o: u32, safe: u32, feasible: u32, probes: Vec<ProbeSummary>) -> BucketResult {
    BucketResult {
        input_tokens: i,
        output_tokens: o,
        feasible_concurrency: feasible,
        infeasible_concurrency: None,
        safe_concurrency: safe,
        binding_constraint: crate::Constraint::KvCache,
        knee_concurrency: None,
        at_feasible: probes.iter().find(|p| p.concurrency == feasible).cloned(),
        feasible_rate_per_s: None,
        safe_rate_per_s: None,
        feasible_upper: None,
        safe_upper: None,
        cached_prefix: None,
        repeats: vec![],
        probes,
    }
}

fn profile() -> Profile {
    Profile {
        schema: PROFILE_SCHEMA.into(),
        created_unix_ms: 1,
        fingerprint: serde_json::json!({}),
        slo: Slo::default(),
        configs: vec![ConfigResult {
            name: "c".into(),
            precision: "f16".into(),
            kv_dtype: "f16".into(),
            batch_policy: "continuous".into(),
            max_num_seqs: 64,
            backend: None,
            memory: MemoryReport {
                kv_capacity_tokens: 1_000_000,
                ..Default::default()
            },
            buckets: vec![
                // The safe point (10) was probed: its figures are used as they are.
                bucket(
                    2048,
                    512,
                    10,
                    12,
                    vec![
                        probe(10, 2_000.0, 40_000.0, 3_000.0, 5_000.0),
                        probe(12, 2_200.0, 44_000.0, 3_500.0, 6_000.0),
                    ],
                ),
                // Only the feasible probe (16): scaled by 8/16.
                bucket(
                    8192,
                    2048,
                    8,
                    16,
                    vec![probe(16, 1_600.0, 80_000.0, 9_000.0, 12_000.0)],
                ),
                bucket(
                    16384,
                    2048,
                    4,
                    5,
                    vec![probe(5, 500.0, 50_000.0, 9_000.0, 12_000.0)],
                ),
            ],
            error: None,
            server_checks: None,
            time_to_ready_s: None,
            workload: None,
            trace: None,
        }],
        selected: "c".into(),
        limits: Some(Limits {
            max_context_tokens: 18432,
            max_output_tokens: 2048,
            max_concurrent_seqs: 64,
            max_kv_tokens_in_flight: 500_000,
            buckets: vec![],
        }),
        no_safe_point: None,
        probes_total: 4,
        quality: None,
        load: None,
    }
}

#[test]
fn demand_reproduces_the_seed_through_the_workload() {
    let w = Workload::from_toml(SEED, "seed.toml").unwrap();
    let p = plan(&w, &profile(), None).unwrap();
    let a = &p.demand[0];
    close(a.model_requests_per_min, 466.56);
    close(a.input_tokens_per_min, 3_359_232.0);
    close(a.output_tokens_per_min, 559_872.0);
    close(a.arrivals_per_s_mean, 3.0);
    close(a.in_flight_littles_law, 18.0);
    close(a.peak_scenario_slots, 24.0);
    close(a.provisioned_slots, 42.0);
    close(a.dependencies_per_min["vector_queries"], 540.0);
    close(a.dependencies_per_min["tool_writes"], 90.0);
    assert_eq!(a.time_in_system_source, "workload");
    let s = &p.demand[1];
    close(s.input_tokens_per_min, 1_958_880.0);
    close(s.output_tokens_per_min, 307_824.0);
    let t = &p.demand[2];
    close(t.model_requests_per_min, 444.96);
    close(t.amplification, 1.08 * 1.03);
}

#[test]
fn supply_picks_the_smallest_covering_bucket_and_the_safe_probe() {
    let w = Workload::from_toml(SEED, "seed.toml").unwrap();
    let p = plan(&w, &profile(), None).unwrap();
    // agent: p95 7,900 in / 1,900 out -> 8192x2048, only the feasible probe: scaled 8/16.
    let a = &p.supply[0];
    assert_eq!(
        (a.bucket_input_tokens, a.bucket_output_tokens),
        (8192, 2048)
    );
    assert!(a.bucket_covers_p95);
    close(a.output_tok_per_s_per_replica, 800.0);
    close(a.prefill_tok_per_s_per_replica, 40_000.0);
    assert!(
        a.supply_probe.contains("scaled by 8/16"),
        "{}",
        a.supply_probe
    );
    // The selected config's KV limit (500k) is below the pool (1M).
    close(a.kv_tokens_per_replica, 500_000.0);
    assert_eq!(a.kv_tokens_source, "limits.max_kv_tokens_in_flight");
    // triage: 1,500 / 400 -> 2048x512, the probe at the safe point itself.
    let t = &p.supply[2];
    assert_eq!((t.bucket_input_tokens, t.bucket_output_tokens), (2048, 512));
    close(t.output_tok_per_s_per_replica, 2_000.0);
    assert!(t.supply_probe.contains("safe concurrency 10"));
    // summarise gets no request time from the workload: the profile's e2e.
    close(p.demand[1].time_in_system_s_mean, 9.0);
    close(p.demand[1].time_in_system_s_p95, 12.0);
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
}

#[test]
fn a_class_no_bucket_covers_is_said_clearly() {
    let w = Workload::from_toml(
        &SEED.replace("input_tokens_p95 = 7900", "input_tokens_p95 = 20000"),
        "seed.toml",
    )
    .unwrap();
    let p = plan(&w, &profile(), None).unwrap();
    assert!(!p.supply[0].bucket_covers_p95);
    assert_eq!(p.supply[0].bucket_input_tokens, 16384);
    assert!(p.warnings[0].contains("no bucket") && p.warnings[0].contains("agent"));
}

#[test]
fn scenarios_sum_classes_and_name_binding_and_next() {
    let w = Workload::from_toml(SEED, "seed.toml").unwrap();
    let p = plan(&w, &profile(), None).unwrap();
    let names: Vec<_> = p.scenarios.iter().map(|s| s.scenario.as_str()).collect();
    assert_eq!(names, ["base", "planned_peak", "failover", "recovery"]);
    let base = &p.scenarios[0];
    let slots = base
        .constraints
        .iter()
        .find(|c| c.constraint == PlanConstraint::ConcurrencySlots)
        .unwrap();
    // agent 18 slots / 8 per replica + summarise (279.84/60 x 9 s) / 8 + triage (444.96/60 x 3 s) / 10.
    let summarise = 279.84 / 60.0 * 9.0;
    let triage = 444.96 / 60.0 * 3.0;
    close(slots.demand, 18.0 + summarise + triage);
    close(
        slots.replicas_exact,
        18.0 / 8.0 + summarise / 8.0 + triage / 10.0,
    );
    // output tok/s: agent 559,872/60 / 800 + summarise 307,824/60 / 800 + triage (444.96 x 200)/60 / 2,000.
    let out = base
        .constraints
        .iter()
        .find(|c| c.constraint == PlanConstraint::OutputTokPerS)
        .unwrap();
    let want =
        559_872.0 / 60.0 / 800.0 + 307_824.0 / 60.0 / 800.0 + 444.96 * 200.0 / 60.0 / 2_000.0;
    close(out.replicas_exact, want);
    // Output throughput binds here (18.1 replicas), before slots (about 8.2).
    assert_eq!(base.binding, PlanConstraint::OutputTokPerS);
    assert_eq!(base.replicas, replicas_for(want));
    let bind = base
        .constraints
        .iter()
        .find(|c| c.constraint == base.binding)
        .unwrap();
    assert!(bind.utilisation <= 1.0 && bind.utilisation > 0.9);
    assert!(base.next.is_some() && base.next != Some(base.binding));
    // Planned peak uses provisioned slots: agent 42.
    let peak = &p.scenarios[1];
    close(peak.loads[0].slots, 42.0);
    assert!(peak.replicas >= base.replicas);
    // Failover: p95 arrivals x 1.5 x 1.2 x p95 time (agent: 3 x 1.8 x 8).
    close(p.scenarios[2].loads[0].slots, 43.2);
    // Recovery: mean x 2 backlog: agent 36 runs in flight.
    close(p.scenarios[3].loads[0].slots, 36.0);
}

#[test]
fn replicas_round_up_but_not_on_float_noise() {
    assert_eq!(replicas_for(0.0), 0);
    assert_eq!(replicas_for(0.2), 1);
    assert_eq!(replicas_for(2.0000000000001), 2);
    assert_eq!(replicas_for(2.01), 3);
}

#[test]
fn unusable_supply_is_an_error() {
    let w = Workload::from_toml(SEED, "seed.toml").unwrap();
    let mut pr = profile();
    assert!(matches!(
        plan(&w, &pr, Some("nope")),
        Err(PlanError::NoConfig(..))
    ));
    pr.configs[0].buckets[1].safe_concurrency = 0;
    assert_eq!(
        plan(&w, &pr, None).unwrap_err(),
        PlanError::NoSafePoint("c".into(), 8192, 2048)
    );
}

#[test]
fn sessions_grow_their_context_and_prefill_is_sized_at_the_hit_rate_floor() {
    let text = SEED.replace(
        "concurrency_basis = \"run\"",
        "concurrency_basis = \"run\"\nsession = true\ntool_result_tokens = 300\ncache_hit_rate = 0.8\ncache_hit_rate_floor = 0.2",
    );
    let w = Workload::from_toml(&text, "seed.toml").unwrap();
    let mut prof = profile();
    // A warm bucket of the agent's shape with twice the sequences: the
    // cache's gain, which the supply never takes.
    let mut warm = prof.configs[0]
        .buckets
        .iter()
        .find(|b| b.input_tokens == 16384)
        .unwrap()
        .clone();
    warm.safe_concurrency *= 2;
    warm.cached_prefix = Some(crate::CachedPrefix::judged(0.8, Some(0.8)));
    // First in the list: the one a bucket search that ignored warmth takes.
    prof.configs[0].buckets.insert(0, warm);
    let p = plan(&w, &prof, None).unwrap();
    let a = &p.demand[0];
    // Each call grows by the mean output and the tool result: 1,500
    // tokens; 2.4 calls a run, so the mean call carries 0.7 of a growth
    // and the last 1.4.
    close(a.context_growth_tokens_per_call, 1_500.0);
    close(a.input_tokens_per_request_mean, 7_200.0 + 1_050.0);
    close(a.input_tokens_per_request_p95, 7_900.0 + 2_100.0);
    close(a.kv_tokens_per_request_p95, 10_000.0 + 1_900.0);
    close(a.input_tokens_per_min, 466.56 * 8_250.0);
    // p95 10,000 input: no bucket covers it, and the warm one is not taken.
    assert_eq!(p.supply[0].bucket_input_tokens, 16384);
    let cold16k = prof.configs[0]
        .buckets
        .iter()
        .find(|b| b.input_tokens == 16384 && b.is_cold())
        .unwrap();
    close(
        p.supply[0].safe_concurrency_per_replica,
        f64::from(cold16k.safe_concurrency),
    );
    let base = &p.scenarios[0];
    let l = &base.loads[0];
    close(l.input_tokens_per_s, 466.56 * 8_250.0 / 60.0);
    close(l.uncached_input_tokens_per_s, l.input_tokens_per_s * 0.8);
    close(
        l.uncached_input_tokens_per_s_planned,
        l.input_tokens_per_s * 0.2,
    );
    let prefill = base
        .constraints
        .iter()
        .find(|c| c.constraint == PlanConstraint::PrefillTokPerS)
        .unwrap();
    // Sized at the floor; the planned rate shown beside it, smaller.
    let per = p.supply[0].prefill_tok_per_s_per_replica;
    let others: f64 = base.loads[1..]
        .iter()
        .zip(&p.supply[1..])
        .map(|(l, s)| l.input_tokens_per_s / s.prefill_tok_per_s_per_replica)
        .sum();
    close(
        prefill.replicas_exact,
        l.uncached_input_tokens_per_s / per + others,
    );
    close(
        prefill.replicas_exact_at_planned_hit_rate.unwrap(),
        l.uncached_input_tokens_per_s_planned / per + others,
    );
    // KV stays on the whole context.
    close(l.kv_tokens, l.slots * 11_900.0);
    // Without a cache rate the constraint shows no second figure, and a
    // floor above the planned rate is refused, naming the field.
    let cold = plan(
        &Workload::from_toml(SEED, "seed.toml").unwrap(),
        &prof,
        None,
    )
    .unwrap();
    assert!(cold.scenarios[0]
        .constraints
        .iter()
        .all(|c| c.replicas_exact_at_planned_hit_rate.is_none()));
    let e = Workload::from_toml(
        &text.replace("cache_hit_rate = 0.8", "cache_hit_rate = 0.1"),
        "w.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("class[0].cache_hit_rate_floor"), "{e}");
    let rendered = crate::plan::render::render(&p, "w.toml", "p.json");
    assert!(
        rendered.contains("at the planned cache hit rate"),
        "{rendered}"
    );
}
