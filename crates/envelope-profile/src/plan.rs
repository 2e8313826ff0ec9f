//! Capacity planning: a workload's demand against a profile's measured
//! supply. Pure arithmetic (no I/O): every intermediate value is kept in a
//! struct so the CLI can print it, and the units are in the field names.
//!
//! Concurrency has two estimates that are never merged: Little's law (mean
//! arrival rate x mean time in system) for the base scenario, and the
//! peak-scenario estimate (p95 arrival rate x p95 time in system), from
//! which provisioned slots add the burst, operational and failover reserves.

use crate::workload::{ConcurrencyBasis, Reserves, ScenarioFactors, TaskClass, Workload};
use crate::{BucketResult, ConfigResult, ProbeSummary, Profile};
use serde::Serialize;
use std::collections::BTreeMap;

/// Model requests per minute: runs x calls per run x retry x fallback.
pub fn model_requests_per_min(
    runs_per_min: f64,
    model_calls_per_run: f64,
    retry_amplification: f64,
    fallback_amplification: f64,
) -> f64 {
    runs_per_min * model_calls_per_run * retry_amplification * fallback_amplification
}

/// Tokens per minute: requests per minute x tokens per request.
pub fn tokens_per_min(model_requests_per_min: f64, tokens_per_request: f64) -> f64 {
    model_requests_per_min * tokens_per_request
}

/// Little's law: mean number in the system = mean arrival rate x mean time
/// in system. Only meaningful with means.
pub fn littles_law_in_flight(mean_arrival_per_s: f64, mean_time_in_system_s: f64) -> f64 {
    mean_arrival_per_s * mean_time_in_system_s
}

/// The peak-scenario estimate: p95 arrival rate x p95 time in system. Not a
/// percentile of concurrency (percentiles do not multiply); a planning figure.
pub fn peak_scenario_slots(p95_arrival_per_s: f64, p95_time_in_system_s: f64) -> f64 {
    p95_arrival_per_s * p95_time_in_system_s
}

/// Provisioned slots = peak x (1 + burst + operational + failover).
pub fn provisioned_slots(peak_slots: f64, reserves: &Reserves) -> f64 {
    peak_slots * reserves.factor()
}

/// Demand of one task class, every step kept.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassDemand {
    pub class: String,
    pub runs_per_min: f64,
    pub runs_per_min_p95: f64,
    pub model_calls_per_run: f64,
    pub retry_amplification: f64,
    pub fallback_amplification: f64,
    /// retry x fallback.
    pub amplification: f64,
    pub model_requests_per_min: f64,
    pub model_requests_per_min_p95: f64,
    pub input_tokens_per_request_p50: f64,
    pub input_tokens_per_request_p95: f64,
    pub input_tokens_per_request_mean: f64,
    pub output_tokens_per_request_p50: f64,
    pub output_tokens_per_request_p95: f64,
    pub output_tokens_per_request_mean: f64,
    /// Sessions (`session = true`): tokens a call's prompt grows by per
    /// call before it (mean output + `tool_result_tokens`), added to the
    /// first call's figures above (the mean call's growth to the mean, the
    /// last call's to the p95); 0 otherwise.
    pub context_growth_tokens_per_call: f64,
    /// The planned share of prompt tokens found cached, and the floor the
    /// plan sizes prefill on.
    pub cache_hit_rate: f64,
    pub cache_hit_rate_floor: f64,
    /// model requests/min x mean input tokens.
    pub input_tokens_per_min: f64,
    pub output_tokens_per_min: f64,
    pub dependencies_per_min: BTreeMap<String, f64>,
    pub concurrency_basis: ConcurrencyBasis,
    /// Arrivals of the slot holder (requests or runs).
    pub arrivals_per_s_mean: f64,
    pub arrivals_per_s_p95: f64,
    pub time_in_system_s_mean: f64,
    pub time_in_system_s_p95: f64,
    /// `workload`, or the profile probe the time came from.
    pub time_in_system_source: String,
    /// Little's law: arrivals_per_s_mean x time_in_system_s_mean.
    pub in_flight_littles_law: f64,
    /// arrivals_per_s_p95 x time_in_system_s_p95.
    pub peak_scenario_slots: f64,
    pub reserve_factor: f64,
    /// peak_scenario_slots x reserve_factor.
    pub provisioned_slots: f64,
    /// p95 input + p95 output: the most KV a request holds (at its end).
    pub kv_tokens_per_request_p95: f64,
}

/// Supply of one replica for one class: the bucket that covers its p95 tokens.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassSupply {
    pub class: String,
    pub config: String,
    pub bucket_input_tokens: u32,
    pub bucket_output_tokens: u32,
    /// False when no bucket covers the class's p95 tokens (the largest is
    /// used, and the supply is optimistic).
    pub bucket_covers_p95: bool,
    pub safe_concurrency_per_replica: f64,
    /// Which probe the throughputs come from.
    pub supply_probe: String,
    pub prefill_tok_per_s_per_replica: f64,
    pub decode_tok_per_s_per_replica: f64,
    pub output_tok_per_s_per_replica: f64,
    /// Latency is not scaled: it is the probe's own, at this concurrency.
    pub latency_probe_concurrency: u32,
    pub e2e_s_mean: f64,
    pub e2e_s_p95: f64,
    pub kv_tokens_per_replica: f64,
    pub kv_tokens_source: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanConstraint {
    ConcurrencySlots,
    OutputTokPerS,
    PrefillTokPerS,
    KvTokens,
}

impl PlanConstraint {
    pub const ALL: [PlanConstraint; 4] = [
        PlanConstraint::ConcurrencySlots,
        PlanConstraint::OutputTokPerS,
        PlanConstraint::PrefillTokPerS,
        PlanConstraint::KvTokens,
    ];
    pub fn as_str(&self) -> &'static str {
        match self {
            PlanConstraint::ConcurrencySlots => "concurrency_slots",
            PlanConstraint::OutputTokPerS => "output_tok_per_s",
            PlanConstraint::PrefillTokPerS => "prefill_tok_per_s",
            PlanConstraint::KvTokens => "kv_tokens",
        }
    }
    pub fn unit(&self) -> &'static str {
        match self {
            PlanConstraint::ConcurrencySlots => "slots",
            PlanConstraint::OutputTokPerS | PlanConstraint::PrefillTokPerS => "tok/s",
            PlanConstraint::KvTokens => "tokens",
        }
    }
}

/// One class in one scenario: the load it offers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassLoad {
    pub class: String,
    pub model_requests_per_s: f64,
    pub input_tokens_per_s: f64,
    /// Input tokens the server must compute: at the class's hit-rate
    /// floor (what prefill is sized on), and at its planned hit rate.
    pub uncached_input_tokens_per_s: f64,
    pub uncached_input_tokens_per_s_planned: f64,
    pub output_tokens_per_s: f64,
    pub slots: f64,
    /// How `slots` was computed.
    pub slots_basis: String,
    pub kv_tokens: f64,
}

/// One constraint in one scenario, summed over classes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConstraintNeed {
    pub constraint: PlanConstraint,
    pub demand: f64,
    pub unit: String,
    /// Sum over classes of demand / per-replica supply.
    pub replicas_exact: f64,
    pub replicas_needed: u64,
    /// replicas_exact / the scenario's replica count.
    pub utilisation: f64,
    /// `prefill_tok_per_s` where a class plans cache hits above its floor:
    /// the replicas prefill needs at the planned hit rate (the sizing
    /// above is at the floor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas_exact_at_planned_hit_rate: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioPlan {
    pub scenario: String,
    pub description: String,
    pub loads: Vec<ClassLoad>,
    pub constraints: Vec<ConstraintNeed>,
    pub replicas: u64,
    pub binding: PlanConstraint,
    pub next: Option<PlanConstraint>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub workload: String,
    pub config: String,
    pub reserves: ReservesOut,
    pub scenario_factors: ScenarioFactorsOut,
    pub demand: Vec<ClassDemand>,
    pub supply: Vec<ClassSupply>,
    pub scenarios: Vec<ScenarioPlan>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReservesOut {
    pub burst: f64,
    pub operational: f64,
    pub failover: f64,
    pub factor: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScenarioFactorsOut {
    pub failover_traffic_factor: f64,
    pub failover_retry_amplification: f64,
    pub recovery_backlog_factor: f64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("profile has no configuration `{0}` (have: {1})")]
    NoConfig(String, String),
    #[error("configuration `{0}` failed in the sweep ({1}): it has no supply")]
    FailedConfig(String, String),
    #[error("configuration `{0}` has no buckets")]
    NoBuckets(String),
    #[error(
        "bucket {1}x{2} of configuration `{0}` has no safe point (safe concurrency 0 or no probe)"
    )]
    NoSafePoint(String, u32, u32),
}

/// The probe that describes a bucket's safe point: a valid probe at the safe
/// concurrency with no breach, else the feasible probe with its throughputs
/// to be scaled by safe / feasible (its latencies, from a higher
/// concurrency, are conservative). Returns (probe, throughput scale, which).
pub fn safe_point_probe(b: &BucketResult) -> Option<(&ProbeSummary, f64, String)> {
    if b.safe_concurrency == 0 {
        return None;
    }
    let at_safe = b
        .probes
        .iter()
        .rev()
        .find(|p| p.valid && p.concurrency == b.safe_concurrency && p.breaches.is_empty());
    match (at_safe, &b.at_feasible) {
        (Some(p), _) => Some((
            p,
            1.0,
            format!("probe at safe concurrency {}", p.concurrency),
        )),
        (None, Some(p)) if p.concurrency > 0 => Some((
            p,
            b.safe_concurrency as f64 / p.concurrency as f64,
            format!(
                "feasible probe (concurrency {}) scaled by {}/{}",
                p.concurrency, b.safe_concurrency, p.concurrency
            ),
        )),
        _ => None,
    }
}

/// The smallest bucket (by input + output tokens) covering both p95s, or the
/// largest bucket and `false` when none covers them.
pub fn choose_bucket(
    buckets: &[BucketResult],
    input_tokens_p95: f64,
    output_tokens_p95: f64,
) -> Option<(&BucketResult, bool)> {
    let size = |b: &BucketResult| {
        (
            b.input_tokens as u64 + b.output_tokens as u64,
            b.input_tokens,
        )
    };
    let covering = buckets
        .iter()
        .filter(|b| {
            b.input_tokens as f64 >= input_tokens_p95 && b.output_tokens as f64 >= output_tokens_p95
        })
        .min_by_key(|b| size(b));
    match covering {
        Some(b) => Some((b, true)),
        None => buckets.iter().max_by_key(|b| size(b)).map(|b| (b, false)),
    }
}

fn supply_for(
    profile: &Profile,
    cfg: &ConfigResult,
    class: &TaskClass,
    warnings: &mut Vec<String>,
) -> Result<ClassSupply, PlanError> {
    // The cold buckets: warm ones measure a cache the plan does not assume.
    let cold: Vec<BucketResult> = cfg
        .buckets
        .iter()
        .filter(|b| b.is_cold())
        .cloned()
        .collect();
    let input_p95 = CallInput::of(class).p95;
    let (b, covers) = choose_bucket(&cold, input_p95, class.output_tokens_p95)
        .ok_or_else(|| PlanError::NoBuckets(cfg.name.clone()))?;
    if !covers {
        warnings.push(format!(
            "class `{}`: no bucket of `{}` covers p95 {} input / {} output tokens; using the largest ({}x{}), so its supply is optimistic",
            class.name, cfg.name, input_p95, class.output_tokens_p95, b.input_tokens, b.output_tokens
        ));
    }
    let no_safe = || PlanError::NoSafePoint(cfg.name.clone(), b.input_tokens, b.output_tokens);
    if b.safe_concurrency == 0 {
        return Err(no_safe());
    }
    let (probe, scale, what) = safe_point_probe(b).ok_or_else(no_safe)?;
    let mut kv = cfg.memory.kv_capacity_tokens as f64;
    let mut kv_source = format!("configs[{}].memory.kv_capacity_tokens", cfg.name);
    let selected_kv = profile.limits.as_ref().map(|l| l.max_kv_tokens_in_flight);
    if let Some(limit) = selected_kv.filter(|l| cfg.name == profile.selected && (*l as f64) < kv) {
        kv = limit as f64;
        kv_source = "limits.max_kv_tokens_in_flight".into();
    }
    Ok(ClassSupply {
        class: class.name.clone(),
        config: cfg.name.clone(),
        bucket_input_tokens: b.input_tokens,
        bucket_output_tokens: b.output_tokens,
        bucket_covers_p95: covers,
        safe_concurrency_per_replica: b.safe_concurrency as f64,
        supply_probe: what,
        prefill_tok_per_s_per_replica: probe.prefill_tok_per_s * scale,
        decode_tok_per_s_per_replica: probe.decode_tok_per_s * scale,
        output_tok_per_s_per_replica: probe.output_tok_per_s * scale,
        latency_probe_concurrency: probe.concurrency,
        e2e_s_mean: probe.e2e_ms.mean / 1000.0,
        e2e_s_p95: probe.e2e_ms.p95 / 1000.0,
        kv_tokens_per_replica: kv,
        kv_tokens_source: kv_source,
    })
}

/// A class's input tokens per call with its context growth: a session's
/// call k (from 0) resends the k calls before it, each grown by its output
/// and a tool result, so the mean call carries (calls - 1) / 2 growths and
/// the p95 (the last call) calls - 1. Without sessions, the class's figures.
struct CallInput {
    mean: f64,
    p50: f64,
    p95: f64,
    /// Tokens a call grows by: mean output + `tool_result_tokens`.
    growth: f64,
}

impl CallInput {
    fn of(c: &TaskClass) -> CallInput {
        let growth = if c.session {
            c.output_tokens_mean.unwrap_or(c.output_tokens_p50) + f64::from(c.tool_result_tokens)
        } else {
            0.0
        };
        let before_last = (c.model_calls_per_run - 1.0).max(0.0);
        CallInput {
            mean: c.input_tokens_mean.unwrap_or(c.input_tokens_p50) + growth * before_last / 2.0,
            p50: c.input_tokens_p50 + growth * before_last / 2.0,
            p95: c.input_tokens_p95 + growth * before_last,
            growth,
        }
    }
}

/// The demand side of one class; `supply` gives default times in system.
pub fn class_demand(
    c: &TaskClass,
    reserves: &Reserves,
    supply: Option<&ClassSupply>,
) -> ClassDemand {
    let amplification = c.retry_amplification * c.fallback_amplification;
    let runs_p95 = c.runs_per_min_p95.unwrap_or(c.runs_per_min);
    let req = model_requests_per_min(
        c.runs_per_min,
        c.model_calls_per_run,
        c.retry_amplification,
        c.fallback_amplification,
    );
    let req_p95 = model_requests_per_min(
        runs_p95,
        c.model_calls_per_run,
        c.retry_amplification,
        c.fallback_amplification,
    );
    let out_mean = c.output_tokens_mean.unwrap_or(c.output_tokens_p50);
    let CallInput {
        mean: in_mean,
        p50: in_p50,
        p95: in_p95,
        growth,
    } = CallInput::of(c);
    let (arr_mean, arr_p95) = match c.concurrency_basis {
        ConcurrencyBasis::ModelRequest => (req / 60.0, req_p95 / 60.0),
        ConcurrencyBasis::Run => (c.runs_per_min / 60.0, runs_p95 / 60.0),
    };
    let (t_mean, t_p95, source) = match (c.time_in_system_s_mean, c.time_in_system_s_p95, supply) {
        (Some(m), Some(p), _) => (m, p, "workload".to_string()),
        (m, p, Some(s)) => (
            m.unwrap_or(s.e2e_s_mean),
            p.unwrap_or(s.e2e_s_p95),
            format!(
                "the profile's e2e at concurrency {} (the workload gives none)",
                s.latency_probe_concurrency
            ),
        ),
        (m, p, None) => (m.unwrap_or(0.0), p.unwrap_or(0.0), "none".into()),
    };
    let in_flight = littles_law_in_flight(arr_mean, t_mean);
    let peak = peak_scenario_slots(arr_p95, t_p95);
    ClassDemand {
        class: c.name.clone(),
        runs_per_min: c.runs_per_min,
        runs_per_min_p95: runs_p95,
        model_calls_per_run: c.model_calls_per_run,
        retry_amplification: c.retry_amplification,
        fallback_amplification: c.fallback_amplification,
        amplification,
        model_requests_per_min: req,
        model_requests_per_min_p95: req_p95,
        input_tokens_per_request_p50: in_p50,
        input_tokens_per_request_p95: in_p95,
        input_tokens_per_request_mean: in_mean,
        context_growth_tokens_per_call: growth,
        cache_hit_rate: c.cache_hit_rate.unwrap_or(0.0),
        cache_hit_rate_floor: c.cache_hit_rate_floor.unwrap_or(0.0),
        output_tokens_per_request_p50: c.output_tokens_p50,
        output_tokens_per_request_p95: c.output_tokens_p95,
        output_tokens_per_request_mean: out_mean,
        input_tokens_per_min: tokens_per_min(req, in_mean),
        output_tokens_per_min: tokens_per_min(req, out_mean),
        dependencies_per_min: c
            .dependencies_per_run
            .iter()
            .map(|(k, v)| (k.clone(), c.runs_per_min * v))
            .collect(),
        concurrency_basis: c.concurrency_basis,
        arrivals_per_s_mean: arr_mean,
        arrivals_per_s_p95: arr_p95,
        time_in_system_s_mean: t_mean,
        time_in_system_s_p95: t_p95,
        time_in_system_source: source,
        in_flight_littles_law: in_flight,
        peak_scenario_slots: peak,
        reserve_factor: reserves.factor(),
        provisioned_slots: provisioned_slots(peak, reserves),
        kv_tokens_per_request_p95: in_p95 + c.output_tokens_p95,
    }
}

/// One class's load in each scenario (base, planned_peak, failover, recovery).
fn class_loads(d: &ClassDemand, f: &ScenarioFactors) -> [ClassLoad; 4] {
    let input =
        |req_per_min: f64| tokens_per_min(req_per_min, d.input_tokens_per_request_mean) / 60.0;
    let load = |req_per_min: f64, slots: f64, basis: String| ClassLoad {
        class: d.class.clone(),
        model_requests_per_s: req_per_min / 60.0,
        input_tokens_per_s: input(req_per_min),
        uncached_input_tokens_per_s: input(req_per_min) * (1.0 - d.cache_hit_rate_floor),
        uncached_input_tokens_per_s_planned: input(req_per_min) * (1.0 - d.cache_hit_rate),
        output_tokens_per_s: tokens_per_min(req_per_min, d.output_tokens_per_request_mean) / 60.0,
        slots,
        slots_basis: basis,
        kv_tokens: slots * d.kv_tokens_per_request_p95,
    };
    let failover = f.failover_traffic_factor * f.failover_retry_amplification;
    [
        load(
            d.model_requests_per_min,
            d.in_flight_littles_law,
            "Little's law: mean arrivals x mean time in system".into(),
        ),
        load(
            d.model_requests_per_min_p95 * d.reserve_factor,
            d.provisioned_slots,
            format!(
                "provisioned: p95 arrivals x p95 time x {:.2} reserves",
                d.reserve_factor
            ),
        ),
        load(
            d.model_requests_per_min_p95 * failover,
            peak_scenario_slots(d.arrivals_per_s_p95 * failover, d.time_in_system_s_p95),
            format!("p95 arrivals x {failover:.3} failover x p95 time"),
        ),
        load(
            d.model_requests_per_min * f.recovery_backlog_factor,
            littles_law_in_flight(
                d.arrivals_per_s_mean * f.recovery_backlog_factor,
                d.time_in_system_s_mean,
            ),
            format!(
                "mean arrivals x {:.2} backlog x mean time",
                f.recovery_backlog_factor
            ),
        ),
    ]
}

fn demand_of(l: &ClassLoad, c: PlanConstraint) -> f64 {
    match c {
        PlanConstraint::ConcurrencySlots => l.slots,
        PlanConstraint::OutputTokPerS => l.output_tokens_per_s,
        PlanConstraint::PrefillTokPerS => l.uncached_input_tokens_per_s,
        PlanConstraint::KvTokens => l.kv_tokens,
    }
}

fn supply_of(s: &ClassSupply, c: PlanConstraint) -> f64 {
    match c {
        PlanConstraint::ConcurrencySlots => s.safe_concurrency_per_replica,
        PlanConstraint::OutputTokPerS => s.output_tok_per_s_per_replica,
        PlanConstraint::PrefillTokPerS => s.prefill_tok_per_s_per_replica,
        PlanConstraint::KvTokens => s.kv_tokens_per_replica,
    }
}

/// Replicas for a demand: ceil, tolerant of floating-point noise just above
/// a whole number (42.000000000001 -> 42).
pub fn replicas_for(replicas_exact: f64) -> u64 {
    if replicas_exact <= 0.0 {
        return 0;
    }
    (replicas_exact - 1e-9 * replicas_exact.max(1.0))
        .ceil()
        .max(0.0) as u64
}

/// Sums classes per constraint and picks the binding and next constraints.
pub fn scenario_plan(
    name: &str,
    description: &str,
    loads: Vec<ClassLoad>,
    supplies: &[ClassSupply],
) -> ScenarioPlan {
    let mut needs: Vec<ConstraintNeed> = PlanConstraint::ALL
        .iter()
        .map(|&c| {
            let (mut demand, mut exact, mut planned) = (0.0, 0.0, 0.0);
            for (l, s) in loads.iter().zip(supplies) {
                let d = demand_of(l, c);
                demand += d;
                let per = supply_of(s, c);
                let share = |d: f64| match d {
                    d if d <= 0.0 => 0.0,
                    d if per > 0.0 => d / per,
                    _ => f64::INFINITY,
                };
                exact += share(d);
                planned += share(l.uncached_input_tokens_per_s_planned);
            }
            // Prefill at the planned hit rate, where some class plans hits
            // above its floor.
            let at_planned = (c == PlanConstraint::PrefillTokPerS
                && loads.iter().any(|l| {
                    l.uncached_input_tokens_per_s_planned < l.uncached_input_tokens_per_s
                }))
            .then_some(planned);
            ConstraintNeed {
                constraint: c,
                demand,
                unit: c.unit().into(),
                replicas_exact: exact,
                replicas_needed: if exact.is_finite() {
                    replicas_for(exact)
                } else {
                    u64::MAX
                },
                utilisation: 0.0,
                replicas_exact_at_planned_hit_rate: at_planned,
            }
        })
        .collect();
    let mut order: Vec<usize> = (0..needs.len()).collect();
    order.sort_by(|&a, &b| {
        needs[b]
            .replicas_exact
            .partial_cmp(&needs[a].replicas_exact)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let replicas = needs[order[0]].replicas_needed.max(1);
    for n in &mut needs {
        n.utilisation = n.replicas_exact / replicas as f64;
    }
    ScenarioPlan {
        scenario: name.into(),
        description: description.into(),
        binding: needs[order[0]].constraint,
        next: order.get(1).map(|&i| needs[i].constraint),
        loads,
        constraints: needs,
        replicas,
    }
}

/// The whole plan for `workload` on configuration `config` of `profile`
/// (`None`: the profile's selected configuration).
pub fn plan(
    workload: &Workload,
    profile: &Profile,
    config: Option<&str>,
) -> Result<Plan, PlanError> {
    let name = config.unwrap_or(&profile.selected);
    let cfg = profile
        .configs
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| {
            PlanError::NoConfig(
                name.into(),
                profile
                    .configs
                    .iter()
                    .map(|c| c.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        })?;
    if let Some(e) = &cfg.error {
        return Err(PlanError::FailedConfig(cfg.name.clone(), e.clone()));
    }
    let mut warnings = vec![];
    let mut supply = vec![];
    let mut demand = vec![];
    for c in &workload.classes {
        let s = supply_for(profile, cfg, c, &mut warnings)?;
        demand.push(class_demand(c, &workload.reserves, Some(&s)));
        supply.push(s);
    }
    let per_class: Vec<[ClassLoad; 4]> = demand
        .iter()
        .map(|d| class_loads(d, &workload.scenarios))
        .collect();
    let descriptions = [
        ("base", "mean arrivals; concurrency by Little's law"),
        (
            "planned_peak",
            "p95 arrivals and p95 time, with burst + operational + failover reserves",
        ),
        (
            "failover",
            "p95 arrivals x failover traffic x failover retry amplification, p95 time, no reserves",
        ),
        (
            "recovery",
            "mean arrivals x backlog factor while draining after an outage",
        ),
    ];
    let scenarios = descriptions
        .iter()
        .enumerate()
        .map(|(i, (n, d))| {
            let loads = per_class.iter().map(|l| l[i].clone()).collect();
            scenario_plan(n, d, loads, &supply)
        })
        .collect();
    let r = workload.reserves;
    let f = workload.scenarios;
    Ok(Plan {
        workload: workload.name.clone(),
        config: cfg.name.clone(),
        reserves: ReservesOut {
            burst: r.burst,
            operational: r.operational,
            failover: r.failover,
            factor: r.factor(),
        },
        scenario_factors: ScenarioFactorsOut {
            failover_traffic_factor: f.failover_traffic_factor,
            failover_retry_amplification: f.failover_retry_amplification,
            recovery_backlog_factor: f.recovery_backlog_factor,
        },
        demand,
        supply,
        scenarios,
        warnings,
    })
}

pub mod render;
pub mod tiers;

#[cfg(test)]
mod tests;
