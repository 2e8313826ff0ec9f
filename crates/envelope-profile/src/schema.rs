//! Profile schema, version 1 (`profiles/schema/profile.schema.json`
//! describes the same shape). Parse, then validate: [`Profile::from_json`]
//! rejects a profile the governor could not enforce, naming the field.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const PROFILE_SCHEMA: &str = "envelope.profile/v1";

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
}

/// What the governor enforces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub max_context_tokens: u64,
    pub max_output_tokens: u64,
    pub max_concurrent_seqs: u64,
    pub max_kv_tokens_in_flight: u64,
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
        let p: Profile = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if p.schema != PROFILE_SCHEMA {
            return Err(bad(format!(
                "field `schema` is `{}`, expected `{PROFILE_SCHEMA}`",
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
        if !(0.0..1.0).contains(&p.slo.headroom) {
            return Err(bad(format!(
                "field `slo.headroom` must be in [0, 1), got {}",
                p.slo.headroom
            )));
        }
        Ok(p)
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
            },
            probes_total: 0,
            quality: None,
        }
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
        assert_eq!(Profile::from_json(&text, "p.json").unwrap(), sample());
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
        assert_eq!(Constraint::KvCache.as_str(), "kv_cache");
        assert_eq!(
            serde_json::to_string(&Constraint::ItlP95).unwrap(),
            "\"itl_p95\""
        );
    }
}
