//! Profile schema, version 2 (`profiles/schema/profile.schema.json`
//! describes the same shape). Parse, then validate: [`Profile::from_json`]
//! rejects a profile the governor could not enforce, naming the field.
//!
//! Version 2 adds `limits.buckets`, the measured envelope per request shape
//! (context bucket -> safe concurrency, KV tokens, latency at that point).
//! A version 1 profile still loads: its table is rebuilt from the selected
//! configuration's sweep results where the profile holds them, else it is
//! one row made of the scalar limits.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const PROFILE_SCHEMA: &str = "envelope.profile/v2";
/// The previous version, still read (see [`Profile::from_json`]).
pub const PROFILE_SCHEMA_V1: &str = "envelope.profile/v1";

/// Why a probe or a configuration stopped being feasible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    TtftP95,
    ItlP95,
    E2eP99,
    Errors,
    KvCache,
    Preemption,
    Oom,
    Crash,
    /// The search reached its concurrency cap without a breach.
    SearchCap,
    /// The load generator could not keep up: nothing can be certified.
    ClientLimited,
}

impl Constraint {
    pub fn as_str(&self) -> &'static str {
        match self {
            Constraint::TtftP95 => "ttft_p95",
            Constraint::ItlP95 => "itl_p95",
            Constraint::E2eP99 => "e2e_p99",
            Constraint::Errors => "errors",
            Constraint::KvCache => "kv_cache",
            Constraint::Preemption => "preemption",
            Constraint::Oom => "oom",
            Constraint::Crash => "crash",
            Constraint::SearchCap => "search_cap",
            Constraint::ClientLimited => "client_limited",
        }
    }
}

/// Service-level objectives a probe must meet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    pub ttft_p95_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    #[serde(default)]
    pub max_error_rate: f64,
    #[serde(default = "one")]
    pub max_kv_usage: f64,
    #[serde(default = "yes")]
    pub zero_preemptions: bool,
    /// Fraction taken off the feasible maximum for the safe point.
    #[serde(default = "tenth")]
    pub headroom: f64,
}

fn one() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}
fn tenth() -> f64 {
    0.1
}

impl Default for Slo {
    fn default() -> Self {
        Slo {
            ttft_p95_ms: None,
            itl_p95_ms: None,
            e2e_p99_ms: None,
            max_error_rate: 0.0,
            max_kv_usage: 1.0,
            zero_preemptions: true,
            headroom: 0.1,
        }
    }
}

/// One probe: a fixed concurrency held for a number of requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, JsonSchema)]
pub struct ProbeSummary {
    pub concurrency: u32,
    pub requests: u64,
    pub errors: u64,
    pub duration_s: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub prefill_tok_per_s: f64,
    pub decode_tok_per_s: f64,
    pub output_tok_per_s: f64,
    pub total_tok_per_s: f64,
    pub request_per_s: f64,
    /// Requests that met every latency SLO, per second.
    pub goodput_req_per_s: f64,
    /// Open-loop (Poisson) probes: the arrival rate asked for; `concurrency`
    /// is then the most requests seen in flight.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered_rate_per_s: Option<f64>,
    pub kv_usage_max: Option<f64>,
    pub preemptions: Option<u64>,
    pub peak_memory_bytes: Option<u64>,
    /// SLOs this probe breached.
    pub breaches: Vec<Constraint>,
    /// The load generator's CPU use as a fraction of all cores (targets
    /// outside this process); over 0.9 the probe is not certified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cpu_fraction: Option<f64>,
    /// False when the load generator could not keep up.
    pub valid: bool,
    /// Failed requests by reason (`short_output`, `no_finish_reason`,
    /// `stream_cut`, `http_429`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub error_reasons: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default, JsonSchema)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BucketResult {
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub feasible_concurrency: u32,
    pub infeasible_concurrency: Option<u32>,
    pub safe_concurrency: u32,
    pub binding_constraint: Constraint,
    /// Concurrency past which throughput grows by under 10% per doubling.
    pub knee_concurrency: Option<u32>,
    /// The probe at the feasible maximum, if any.
    pub at_feasible: Option<ProbeSummary>,
    /// Open-loop (Poisson) sweeps: the highest arrival rate inside the SLOs,
    /// and that rate reduced by the headroom.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feasible_rate_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safe_rate_per_s: Option<f64>,
    pub probes: Vec<ProbeSummary>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, JsonSchema)]
pub struct MemoryReport {
    pub weight_bytes: u64,
    /// Parameters x bytes per parameter of the precision, for comparison.
    pub weight_bytes_analytic: u64,
    pub kv_bytes_per_token: u64,
    pub kv_capacity_tokens: u64,
    pub peak_bytes: Option<u64>,
    /// Memory measured after the model loaded and before any traffic: the
    /// growth of this process's RSS over the load (engine), the launched
    /// server's RSS, or the growth of GPU memory used (NVML).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_after_load_bytes: Option<u64>,
    /// Where the figures come from: `engine` (the embedded engine's own
    /// accounting), `nvml` (GPU memory used), `process_rss` (the launched
    /// server's resident memory) or `none` (fields left 0: not measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// One point of the matrix: precision x KV dtype x batch policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConfigResult {
    pub name: String,
    pub precision: String,
    pub kv_dtype: String,
    pub batch_policy: String,
    pub max_num_seqs: u32,
    pub memory: MemoryReport,
    /// The embedded engine's backend: `cpu`, or the GPU with its kernel
    /// source, GEMM path (cuBLAS or envelope's kernels) and CUDA graph use,
    /// so that figures from different paths are not taken for each other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    pub buckets: Vec<BucketResult>,
    /// Set when the configuration failed (OOM, crash): a data point, not the end.
    pub error: Option<String>,
    /// What the harness found out about a server (http and launch targets)
    /// before it loaded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_checks: Option<ServerChecks>,
    /// Launch targets: seconds from the launch command to the server's first
    /// 2xx on its ready path (its cold start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_ready_s: Option<f64>,
    /// `load.workload`: the workload's safe scale, searched with agent-shaped
    /// load (sessions of calls per task class).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<WorkloadResult>,
}

/// The search over a workload's scale: 1.0 is the workload's mean run rates,
/// 2.0 twice them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadResult {
    pub name: String,
    /// `poisson`, `bursts` or `ramp`.
    pub arrival: String,
    /// The largest scale that met every SLO (0: none did).
    pub feasible_scale: f64,
    /// `feasible_scale` less `slo.headroom`.
    pub safe_scale: f64,
    pub binding_constraint: Constraint,
    /// The saturation curve (goodput against scale): the last scale before
    /// goodput grows at under half its initial rate per unit of scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knee_scale: Option<f64>,
    /// The first scale past the breach whose goodput fell below
    /// `load.collapse_fraction` of the peak (None: not reached within
    /// `load.collapse_probes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collapse_scale: Option<f64>,
    /// Load at the collapse (or the highest probed) scale, then straight
    /// back to the safe scale: how long until the SLOs hold again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
    /// Every probe, by scale (the search's and the collapse steps').
    pub probes: Vec<WorkloadProbe>,
}

/// Overload, then the safe scale without a pause between them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Recovery {
    pub from_scale: f64,
    pub to_scale: f64,
    /// Seconds at each.
    pub overload_s: f64,
    pub window_s: f64,
    /// Seconds from the switch to the first request after which every
    /// request met the SLOs (TTFT, e2e, no error); None: they did not hold
    /// again within the window.
    pub recovery_s: Option<f64>,
    /// Requests started after the switch, and those that missed the SLOs.
    pub requests_after: u64,
    pub missed_after: u64,
}

/// One probe of a workload at a scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadProbe {
    pub scale: f64,
    /// Every request of the probe together (what the SLOs judge).
    pub summary: ProbeSummary,
    /// Per task class.
    pub classes: BTreeMap<String, ClassSummary>,
}

/// One task class's requests and runs within a probe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClassSummary {
    /// Runs (sessions of calls) that started.
    pub runs: u64,
    pub requests: u64,
    pub errors: u64,
    pub input_tokens_mean: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// A whole run, first call sent to last call answered.
    pub run_e2e_ms: Percentiles,
}

/// Whether a server honours what the load relies on, tried with one request
/// before the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerChecks {
    /// Asked `ignore_eos`, the server returned the asked output length.
    /// False: it stopped early with `finish_reason: stop`, so the sweep
    /// measured the lengths the server chose (an answer that stops with a
    /// finish reason counts as complete) and its figures are for outputs
    /// shorter than the buckets name.
    pub ignore_eos: bool,
    /// Prompts sent as token ids were taken at their length. False: the
    /// server refused them, and prompts went as text of one word per token
    /// (lengths approximate).
    pub token_prompts: bool,
    /// What was seen, in words.
    pub notes: Vec<String>,
}

/// What the governor enforces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Prompt + max_tokens of one sequence.
    pub max_context_tokens: u64,
    pub max_output_tokens: u64,
    /// The most sequences in flight of any shape (the largest bucket
    /// concurrency); the per-bucket table bounds a mix.
    pub max_concurrent_seqs: u64,
    pub max_kv_tokens_in_flight: u64,
    /// The envelope per request shape, smallest bucket first. Each admitted
    /// sequence is charged `1 / safe_concurrency` of the node, from the
    /// smallest bucket whose `input_tokens + output_tokens` covers its
    /// prompt + max_tokens. Never empty after [`Profile::from_json`].
    #[serde(default)]
    pub buckets: Vec<BucketLimit>,
}

/// One row of the per-shape envelope: a context bucket as the sweep
/// measured it, and what was safe there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BucketLimit {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Concurrent sequences of this shape that stayed inside every SLO
    /// (feasible less the headroom; at least 1).
    pub safe_concurrency: u64,
    /// KV tokens those sequences hold at most: safe_concurrency x (input + output).
    pub kv_tokens: u64,
    /// Measured at the closest probe at or under the safe concurrency
    /// (None where the sweep has no such probe, or for a migrated row).
    #[serde(default)]
    pub ttft_p95_ms: Option<f64>,
    #[serde(default)]
    pub itl_p95_ms: Option<f64>,
    #[serde(default)]
    pub e2e_p99_ms: Option<f64>,
    /// Output tokens per second and requests per second at that probe.
    #[serde(default)]
    pub output_tok_per_s: Option<f64>,
    #[serde(default)]
    pub request_per_s: Option<f64>,
    /// The probe's concurrency these figures come from.
    #[serde(default)]
    pub measured_at_concurrency: Option<u64>,
}

impl BucketLimit {
    pub fn total_tokens(&self) -> u64 {
        self.input_tokens + self.output_tokens
    }

    /// `64x32`: the label used in metrics, messages and reports.
    pub fn label(&self) -> String {
        format!("{}x{}", self.input_tokens, self.output_tokens)
    }

    /// A row from one bucket of a sweep: safe concurrency at least 1, the
    /// latency figures of the largest valid probe at or under it.
    pub fn from_result(b: &BucketResult) -> BucketLimit {
        let safe = (b.safe_concurrency as u64).max(1);
        let at = b
            .probes
            .iter()
            .filter(|p| p.valid && p.breaches.is_empty() && p.concurrency as u64 <= safe)
            .max_by_key(|p| p.concurrency)
            .or(b.at_feasible.as_ref());
        BucketLimit {
            input_tokens: b.input_tokens as u64,
            output_tokens: b.output_tokens as u64,
            safe_concurrency: safe,
            kv_tokens: safe * (b.input_tokens + b.output_tokens) as u64,
            ttft_p95_ms: at.map(|p| p.ttft_ms.p95),
            itl_p95_ms: at.map(|p| p.itl_ms.p95),
            e2e_p99_ms: at.map(|p| p.e2e_ms.p99),
            output_tok_per_s: at.map(|p| p.output_tok_per_s),
            request_per_s: at.map(|p| p.request_per_s),
            measured_at_concurrency: at.map(|p| p.concurrency as u64),
        }
    }
}

impl Limits {
    /// The limits a configuration's sweep results give: context and output
    /// caps from its largest buckets, concurrency from its largest safe
    /// concurrency, the per-bucket table, and `kv_tokens` for the KV budget.
    pub fn from_config(c: &ConfigResult, kv_tokens: u64) -> Limits {
        let mut buckets: Vec<BucketLimit> =
            c.buckets.iter().map(BucketLimit::from_result).collect();
        sort_buckets(&mut buckets);
        Limits {
            max_context_tokens: buckets.iter().map(|b| b.total_tokens()).max().unwrap_or(1),
            max_output_tokens: buckets.iter().map(|b| b.output_tokens).max().unwrap_or(1),
            max_concurrent_seqs: buckets
                .iter()
                .map(|b| b.safe_concurrency)
                .max()
                .unwrap_or(1),
            max_kv_tokens_in_flight: kv_tokens.max(1),
            buckets,
        }
    }

    /// The single row a table-less (version 1) profile stands for: every
    /// request up to the context cap, at the one concurrency.
    pub fn single_row(&self) -> BucketLimit {
        let input = self
            .max_context_tokens
            .saturating_sub(self.max_output_tokens);
        BucketLimit {
            input_tokens: input,
            output_tokens: self.max_output_tokens,
            safe_concurrency: self.max_concurrent_seqs.max(1),
            kv_tokens: self.max_concurrent_seqs.max(1) * self.max_context_tokens,
            ttft_p95_ms: None,
            itl_p95_ms: None,
            e2e_p99_ms: None,
            output_tok_per_s: None,
            request_per_s: None,
            measured_at_concurrency: None,
        }
    }

    /// The smallest measured bucket covering `total_tokens` (prompt +
    /// max_tokens of one sequence); among buckets of one size the lower
    /// safe concurrency. `None` past the largest bucket.
    pub fn bucket_for(&self, total_tokens: u64) -> Option<(usize, &BucketLimit)> {
        self.buckets
            .iter()
            .enumerate()
            .find(|(_, b)| b.total_tokens() >= total_tokens)
    }

    pub fn largest_bucket(&self) -> Option<&BucketLimit> {
        self.buckets.last()
    }
}

/// Smallest total first; equal totals by safe concurrency, lowest first, so
/// [`Limits::bucket_for`] picks the stricter of two equal-sized rows.
pub fn sort_buckets(b: &mut [BucketLimit]) {
    b.sort_by(|x, y| {
        x.total_tokens()
            .cmp(&y.total_tokens())
            .then(x.safe_concurrency.cmp(&y.safe_concurrency))
    });
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Profile {
    pub schema: String,
    pub created_unix_ms: u64,
    /// envelope-telemetry's fingerprint of node, engine and model.
    pub fingerprint: serde_json::Value,
    pub slo: Slo,
    pub configs: Vec<ConfigResult>,
    /// The configuration the limits come from.
    pub selected: String,
    pub limits: Limits,
    pub probes_total: u32,
    /// `envelope quality`: perplexity, and KL divergence and top-1
    /// agreement against a reference precision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<crate::QualityReport>,
}

/// The JSON Schema of [`Profile`] (committed as `profiles/schema/profile.schema.json`).
pub fn json_schema() -> serde_json::Value {
    serde_json::to_value(schemars::schema_for!(Profile)).unwrap_or_default()
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

impl Profile {
    /// Parses and validates a profile; errors name the field.
    pub fn from_json(text: &str, path: &str) -> Result<Profile, ProfileError> {
        let bad = |m: String| ProfileError::Invalid {
            path: path.to_string(),
            message: m,
        };
        let mut p: Profile = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if p.schema != PROFILE_SCHEMA && p.schema != PROFILE_SCHEMA_V1 {
            return Err(bad(format!(
                "field `schema` is `{}`, expected `{PROFILE_SCHEMA}` (or `{PROFILE_SCHEMA_V1}`)",
                p.schema
            )));
        }
        let l = &p.limits;
        for (name, v) in [
            ("limits.max_context_tokens", l.max_context_tokens),
            ("limits.max_output_tokens", l.max_output_tokens),
            ("limits.max_concurrent_seqs", l.max_concurrent_seqs),
            ("limits.max_kv_tokens_in_flight", l.max_kv_tokens_in_flight),
        ] {
            if v == 0 {
                return Err(bad(format!("field `{name}` must be at least 1")));
            }
        }
        if l.max_output_tokens > l.max_context_tokens {
            return Err(bad(
                "field `limits.max_output_tokens` exceeds `limits.max_context_tokens`".into(),
            ));
        }
        if p.limits.buckets.is_empty() {
            p.limits.buckets = p.migrated_buckets();
            // v1 kept the smallest bucket's concurrency for every request;
            // with the table the cap is the largest and the table bounds a mix.
            let most = p.limits.buckets.iter().map(|b| b.safe_concurrency).max();
            p.limits.max_concurrent_seqs = most.unwrap_or(1).max(p.limits.max_concurrent_seqs);
        }
        sort_buckets(&mut p.limits.buckets);
        for (i, b) in p.limits.buckets.iter().enumerate() {
            if b.safe_concurrency == 0 || b.total_tokens() == 0 {
                return Err(bad(format!(
                    "field `limits.buckets[{i}]` ({}): `safe_concurrency` and `input_tokens + output_tokens` must be at least 1",
                    b.label()
                )));
            }
        }
        if !(0.0..1.0).contains(&p.slo.headroom) {
            return Err(bad(format!(
                "field `slo.headroom` must be in [0, 1), got {}",
                p.slo.headroom
            )));
        }
        Ok(p)
    }

    /// The per-bucket table of a profile written without one (schema v1):
    /// from the selected configuration's buckets where the profile holds
    /// them (the sweep's raw results), else one row of the scalar limits.
    fn migrated_buckets(&self) -> Vec<BucketLimit> {
        let from_sweep: Vec<BucketLimit> = self
            .configs
            .iter()
            .find(|c| c.name == self.selected && c.error.is_none())
            .map(|c| c.buckets.iter().map(BucketLimit::from_result).collect())
            .unwrap_or_default();
        // Rows past the context cap could never be used; a table that does
        // not reach the cap would refuse what v1 admitted.
        let cap = self.limits.max_context_tokens;
        let reaches = from_sweep.iter().any(|b| b.total_tokens() >= cap);
        if !from_sweep.is_empty() && reaches {
            from_sweep
        } else {
            vec![self.limits.single_row()]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Profile {
        Profile {
            schema: PROFILE_SCHEMA.into(),
            created_unix_ms: 1,
            fingerprint: serde_json::json!({"schema": 1}),
            slo: Slo::default(),
            configs: vec![],
            selected: "x".into(),
            limits: Limits {
                max_context_tokens: 2048,
                max_output_tokens: 512,
                max_concurrent_seqs: 8,
                max_kv_tokens_in_flight: 8192,
                buckets: vec![],
            },
            probes_total: 0,
            quality: None,
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
        let l = Limits::from_config(&c, 5000);
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
        p.limits = Limits {
            max_context_tokens: 288,
            max_output_tokens: 32,
            max_concurrent_seqs: 4,
            max_kv_tokens_in_flight: 5000,
            buckets: vec![],
        };
        p.configs = vec![config(vec![
            bucket(64, 32, 13, &[(8, 200.0)]),
            bucket(256, 32, 4, &[(4, 300.0)]),
        ])];
        let mut v = serde_json::to_value(&p).unwrap();
        v["limits"].as_object_mut().unwrap().remove("buckets");
        let got = Profile::from_json(&v.to_string(), "old.json").unwrap();
        assert_eq!(got.limits.buckets.len(), 2);
        assert_eq!(got.limits.max_concurrent_seqs, 13);
        // Without the sweep's results: one row of the scalar limits.
        p.configs.clear();
        let mut v = serde_json::to_value(&p).unwrap();
        v["limits"].as_object_mut().unwrap().remove("buckets");
        let got = Profile::from_json(&v.to_string(), "old.json").unwrap();
        assert_eq!(got.limits.buckets.len(), 1);
        let row = &got.limits.buckets[0];
        assert_eq!((row.label(), row.safe_concurrency), ("256x32".into(), 4));
        assert_eq!(got.limits.max_concurrent_seqs, 4);
    }

    #[test]
    fn committed_json_schema_is_current() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../profiles/schema/profile.schema.json"
        );
        let want = serde_json::to_string_pretty(&json_schema()).unwrap() + "\n";
        if std::env::var_os("ENVELOPE_WRITE_SCHEMA").is_some() {
            std::fs::write(path, &want).unwrap();
        }
        let have = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            have == want,
            "{path} is stale: run ENVELOPE_WRITE_SCHEMA=1 cargo test -p envelope-profile"
        );
    }

    #[test]
    fn round_trips_and_validates() {
        let text = serde_json::to_string(&sample()).unwrap();
        let mut want = sample();
        want.limits.buckets = vec![want.limits.single_row()];
        let got = Profile::from_json(&text, "p.json").unwrap();
        assert_eq!(got, want);
        let again = serde_json::to_string(&got).unwrap();
        assert_eq!(Profile::from_json(&again, "p.json").unwrap(), want);
        let mut p = sample();
        p.limits.max_concurrent_seqs = 0;
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
        p.limits.buckets = vec![p.limits.single_row()];
        p.limits.buckets[0].safe_concurrency = 0;
        let e = Profile::from_json(&serde_json::to_string(&p).unwrap(), "p.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("limits.buckets[0]") && e.contains("1536x512"),
            "{e}"
        );
        assert_eq!(Constraint::KvCache.as_str(), "kv_cache");
        assert_eq!(
            serde_json::to_string(&Constraint::ItlP95).unwrap(),
            "\"itl_p95\""
        );
    }
}
