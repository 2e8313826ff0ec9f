//! Profile schema, version 3 (`profiles/schema/profile.schema.json`
//! describes the same shape). Parse, then validate: [`Profile::from_json`]
//! rejects a profile the governor could not enforce, naming the field.
//!
//! Version 3 allows `limits: null` with `no_safe_point` saying why: a
//! sweep in which no configuration had a safe point writes no limits
//! rather than made-up ones, and [`Profile::enforceable_limits`] refuses
//! it. `server_checks` gained what the sweep learnt of a server: the
//! model ids it serves, its bytes per token on English text and its
//! tokenizer file.
//!
//! Version 2 adds `limits.buckets`, the measured envelope per request shape
//! (context bucket -> safe concurrency, KV tokens, latency at that point).
//! A version 1 profile still loads: its table is rebuilt from the selected
//! configuration's sweep results where the profile holds them, else it is
//! one row made of the scalar limits.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

mod cached_prefix;
mod slo;
pub use cached_prefix::CachedPrefix;
pub use slo::Slo;

pub const PROFILE_SCHEMA: &str = "envelope.profile/v3";
/// Earlier versions, still read (see [`Profile::from_json`]).
pub const PROFILE_SCHEMA_V2: &str = "envelope.profile/v2";
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
    /// A governed target refused (429 with Retry-After) more than
    /// `slo.max_shed_rate` of the requests.
    Shed,
    /// A latency SLO the probe's requests could not decide at
    /// `slo.confidence` within `load.max_requests`: never passed.
    Undecided,
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
            Constraint::Shed => "shed",
            Constraint::Undecided => "undecided",
        }
    }
}

/// One probe: a fixed concurrency held for a number of requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, JsonSchema)]
pub struct ProbeSummary {
    pub concurrency: u32,
    pub requests: u64,
    /// Of `requests`, those sent while a closed loop's workers ramped in:
    /// in the throughput, not in the latency percentiles or verdicts.
    #[serde(default)]
    pub warmup_requests: u64,
    /// Failed requests, refusals not included.
    pub errors: u64,
    /// Requests a governed target refused with 429 and Retry-After (shed,
    /// not failed).
    #[serde(default)]
    pub refused: u64,
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
    /// Prompt tokens found in the server's prefix cache over those looked
    /// up during the probe, from its counters before and after (vLLM's
    /// `prefix_cache_hits_total` / `prefix_cache_queries_total`, or the
    /// answers' `usage.prompt_tokens_details.cached_tokens` where the
    /// server has no counters); `None` where the server tells neither or
    /// looked nothing up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache_hit_rate: Option<f64>,
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
    /// Each latency SLO's evidence and verdict at `slo.confidence`; empty
    /// in profiles from before confidence (their verdicts were points).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slo_checks: Vec<SloCheck>,
}

/// What a probe's requests say of one latency SLO: of `samples` (requests,
/// or token gaps for ITL), `over` exceeded `limit_ms`; the share over it
/// lies in [`over_share_lower`, `over_share_upper`] at `slo.confidence`,
/// and the SLO holds when the upper end is within `1 - percentile`, is
/// breached when the lower end is past it, and is undecided between.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SloCheck {
    /// `ttft_p95`, `itl_p95` or `e2e_p99`.
    pub slo: Constraint,
    pub limit_ms: f64,
    /// 0.95 for a p95.
    pub percentile: f64,
    pub samples: u64,
    pub over: u64,
    pub over_share_lower: f64,
    pub over_share_upper: f64,
    pub decision: crate::confidence::Decision,
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
    /// The interval the feasible maximum is known within at
    /// `slo.confidence`: from the feasible level (which held at that
    /// confidence) up to one below the lowest level whose breach was
    /// decided. Closed loop: a concurrency; open loop: an arrival rate.
    /// `None` when no level above was decided breached (the search cap, or
    /// levels left undecided), and in profiles from before confidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feasible_upper: Option<f64>,
    /// `feasible_upper` less the headroom: the safe point's upper end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safe_upper: Option<f64>,
    /// A warm bucket: its shared prefix and whether the server cached it.
    /// Absent: a cold bucket (every prompt distinct).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_prefix: Option<CachedPrefix>,
    pub probes: Vec<ProbeSummary>,
    /// With `--repeats`: each repeat's search of this bucket, in run order
    /// (the gate compares these, not the single figures above).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats: Vec<BucketRepeat>,
}

/// One repeat of a bucket's search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BucketRepeat {
    pub feasible_concurrency: u32,
    pub safe_concurrency: u32,
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
    /// `[load.trace]`: a replayed trace's safe time-scale factor (`arrival`
    /// is `trace`; a scale of 2.0 is the trace's arrivals twice as fast).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<WorkloadResult>,
}

/// The search over a workload's scale: 1.0 is the workload's mean run rates,
/// 2.0 twice them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkloadResult {
    pub name: String,
    /// `poisson`, `bursts` or `ramp`; `trace` for a replayed trace.
    pub arrival: String,
    /// The largest scale that met every SLO (0: none did).
    pub feasible_scale: f64,
    /// One step below the lowest scale decided breached at
    /// `slo.confidence`: the most the feasible scale can be (None: no
    /// scale was decided breached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feasible_upper_scale: Option<f64>,
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
    /// A replayed trace: per tenant.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenants: BTreeMap<String, ClassSummary>,
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
    /// The server's answers carry `envelope govern`'s headers: the sweep
    /// measured a governed system (refusals are shed load, not failures).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub governed: bool,
    /// The model ids the server's `/v1/models` lists (the governor
    /// compares its upstream's list with these).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub served_models: Vec<String>,
    /// Bytes per token of ordinary English text, from the server's own
    /// `usage.prompt_tokens` for a fixed passage: where a governor cannot
    /// count with a tokenizer, its estimate starts here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_bytes_per_token: Option<f64>,
    /// The served model's tokenizer file (a `.gguf` or `tokenizer.json`),
    /// as the sweep config (`target.tokenizer`) or the server (llama.cpp's
    /// `/props`) names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerFile>,
}

/// A tokenizer file and its digest: a governor loads it only when the file
/// at `path` is there and has this SHA-256.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizerFile {
    pub path: String,
    pub sha256: String,
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
    /// The envelope per request shape, smallest bucket first. An admitted
    /// sequence is counted in the smallest bucket whose `input_tokens +
    /// output_tokens` covers its prompt + max_tokens, and charged
    /// `1 / safe_concurrency` of the node interpolated by its tokens
    /// between that bucket and the one below (the governor's
    /// `policy::charge_for`). Never empty after [`Profile::from_json`].
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
    /// The feasible concurrency less the headroom before it is rounded
    /// down to `safe_concurrency` (at least 1). The governor charges a
    /// sequence `1 /` this, and interpolates between buckets on it, so
    /// that rounding a small bucket down (1.8 to 1) does not tilt the line
    /// for every shape between it and the next. `None` in profiles from
    /// before it (then `safe_concurrency` is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_after_headroom: Option<f64>,
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
    pub fn from_result(b: &BucketResult, headroom: f64) -> BucketLimit {
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
            concurrency_after_headroom: (b.feasible_concurrency > 0).then(|| {
                (b.feasible_concurrency as f64 * (1.0 - crate::capacity::clamp_headroom(headroom)))
                    .max(1.0)
                    .max(safe as f64)
            }),
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
    pub fn from_config(c: &ConfigResult, kv_tokens: u64, headroom: f64) -> Limits {
        // Warm buckets are the cache's gain, not the envelope: the
        // governor credits cached prefixes only as the server confirms them.
        let mut buckets: Vec<BucketLimit> = c
            .buckets
            .iter()
            .filter(|b| b.is_cold())
            .map(|b| BucketLimit::from_result(b, headroom))
            .collect();
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
            concurrency_after_headroom: None,
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
    /// `None` when no configuration had a safe point (`no_safe_point` says
    /// why); such a profile cannot be enforced.
    pub limits: Option<Limits>,
    /// Why `limits` is `None`, per configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_safe_point: Option<String>,
    pub probes_total: u32,
    /// `envelope quality`: perplexity, and KL divergence and top-1
    /// agreement against a reference precision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<crate::QualityReport>,
    /// How the probes loaded the server; `None` in profiles before
    /// 2026-12-06 (whose closed loops started every worker together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadShape>,
}

/// How a sweep's probes loaded the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LoadShape {
    /// `closed` (a fixed number of workers, searched) or `poisson`.
    pub mode: String,
    /// Closed loop: the workers' starts were spread over the median
    /// end-to-end latency of the level below in the bucket (a bucket's
    /// first probe has none), and the requests sent before the last one
    /// started (`warmup_requests` of each probe) are in the throughput but
    /// not in the latency percentiles or verdicts. `false` (the default):
    /// all started together, and each probe's verdict includes that burst.
    pub ramp: bool,
    /// A screening probe's requests: `max(concurrency x rounds,
    /// min_requests)`, plus the warm-up (`concurrency`) when ramped.
    pub rounds: u32,
    pub min_requests: u32,
    /// The most requests a level's probes may send to decide it.
    pub max_requests: Option<u32>,
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
        if ![PROFILE_SCHEMA, PROFILE_SCHEMA_V2, PROFILE_SCHEMA_V1].contains(&p.schema.as_str()) {
            return Err(bad(format!(
                "field `schema` is `{}`, expected `{PROFILE_SCHEMA}` (or `{PROFILE_SCHEMA_V2}`, `{PROFILE_SCHEMA_V1}`)",
                p.schema
            )));
        }
        if p.limits.is_none() && p.no_safe_point.is_none() {
            return Err(bad(
                "field `limits` is null and `no_safe_point` does not say why".into(),
            ));
        }
        if let Some(l) = &p.limits {
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
        }
        if p.limits.as_ref().is_some_and(|l| l.buckets.is_empty()) {
            let migrated = p.migrated_buckets();
            if let Some(l) = p.limits.as_mut() {
                l.buckets = migrated;
                // v1 kept the smallest bucket's concurrency for every request;
                // with the table the cap is the largest and the table bounds a mix.
                let most = l.buckets.iter().map(|b| b.safe_concurrency).max();
                l.max_concurrent_seqs = most.unwrap_or(1).max(l.max_concurrent_seqs);
            }
        }
        if let Some(l) = p.limits.as_mut() {
            sort_buckets(&mut l.buckets);
            for (i, b) in l.buckets.iter().enumerate() {
                if b.safe_concurrency == 0 || b.total_tokens() == 0 {
                    return Err(bad(format!(
                        "field `limits.buckets[{i}]` ({}): `safe_concurrency` and `input_tokens + output_tokens` must be at least 1",
                        b.label()
                    )));
                }
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

    /// The limits to enforce.
    ///
    /// # Errors
    /// The sweep found no safe operating point; the error says why.
    pub fn enforceable_limits(&self) -> Result<&Limits, String> {
        self.limits.as_ref().ok_or_else(|| {
            format!(
                "the profile has no limits: the sweep found no safe operating point ({})",
                self.no_safe_point
                    .as_deref()
                    .unwrap_or("no reason recorded")
            )
        })
    }

    /// The selected configuration's server checks (http and launch targets).
    pub fn selected_checks(&self) -> Option<&ServerChecks> {
        self.configs
            .iter()
            .find(|c| c.name == self.selected)
            .and_then(|c| c.server_checks.as_ref())
    }

    /// The per-bucket table of a profile written without one (schema v1):
    /// from the selected configuration's buckets where the profile holds
    /// them (the sweep's raw results), else one row of the scalar limits.
    fn migrated_buckets(&self) -> Vec<BucketLimit> {
        let from_sweep: Vec<BucketLimit> = self
            .configs
            .iter()
            .find(|c| c.name == self.selected && c.error.is_none())
            .map(|c| {
                c.buckets
                    .iter()
                    .filter(|b| b.is_cold())
                    .map(|b| BucketLimit::from_result(b, self.slo.headroom))
                    .collect()
            })
            .unwrap_or_default();
        // Rows past the context cap could never be used; a table that does
        // not reach the cap would refuse what v1 admitted.
        let Some(limits) = &self.limits else {
            return vec![];
        };
        let cap = limits.max_context_tokens;
        let reaches = from_sweep.iter().any(|b| b.total_tokens() >= cap);
        if !from_sweep.is_empty() && reaches {
            from_sweep
        } else {
            vec![limits.single_row()]
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
