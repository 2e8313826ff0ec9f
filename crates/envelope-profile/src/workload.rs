//! A workload for `envelope plan`: the demand side of a capacity plan, read
//! from TOML and validated into a type whose numbers are all usable (finite,
//! positive where they must be). Errors name the file and the field.
//! `bench-configs/workloads/README.md` documents the fields.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub reserves: Reserves,
    #[serde(default)]
    pub scenarios: ScenarioFactors,
    #[serde(rename = "class")]
    pub classes: Vec<TaskClass>,
}

/// Fractions added on top of the peak-scenario slots:
/// provisioned = peak x (1 + burst + operational + failover).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reserves {
    #[serde(default)]
    pub burst: f64,
    #[serde(default)]
    pub operational: f64,
    #[serde(default)]
    pub failover: f64,
}

impl Default for Reserves {
    fn default() -> Self {
        Reserves {
            burst: 0.25,
            operational: 0.15,
            failover: 0.35,
        }
    }
}

impl Reserves {
    pub fn factor(&self) -> f64 {
        1.0 + self.burst + self.operational + self.failover
    }
}

/// How the failover and recovery scenarios scale demand.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioFactors {
    /// Peak traffic is multiplied by this when another site's traffic fails over here.
    #[serde(default = "one")]
    pub failover_traffic_factor: f64,
    /// Extra retry amplification while failing over (clients retry timeouts).
    #[serde(default = "one")]
    pub failover_retry_amplification: f64,
    /// Rate while draining a backlog after an outage, relative to the mean.
    #[serde(default = "one")]
    pub recovery_backlog_factor: f64,
}

fn one() -> f64 {
    1.0
}

impl Default for ScenarioFactors {
    fn default() -> Self {
        ScenarioFactors {
            failover_traffic_factor: 1.0,
            failover_retry_amplification: 1.0,
            recovery_backlog_factor: 1.0,
        }
    }
}

/// One task class: logical runs (an agent run, a chat turn) that each make
/// some model calls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskClass {
    pub name: String,
    /// Mean arrival rate of logical runs.
    pub runs_per_min: f64,
    /// 95th percentile of the per-minute arrival rate (default: the mean).
    pub runs_per_min_p95: Option<f64>,
    pub model_calls_per_run: f64,
    /// Model requests per logical call, counting retries (1.08 = 8% retried).
    #[serde(default = "one")]
    pub retry_amplification: f64,
    /// Extra requests sent to a fallback model or route (1.03 = 3%).
    #[serde(default = "one")]
    pub fallback_amplification: f64,
    pub input_tokens_p50: f64,
    pub input_tokens_p95: f64,
    /// Mean input tokens per call, for token rates (default: the p50).
    pub input_tokens_mean: Option<f64>,
    pub output_tokens_p50: f64,
    pub output_tokens_p95: f64,
    pub output_tokens_mean: Option<f64>,
    /// What holds a replica slot for Little's law: each model request
    /// (default), or each logical run (runs whose calls are sequential hold
    /// at most one slot each, for the whole run).
    #[serde(default)]
    pub concurrency_basis: ConcurrencyBasis,
    /// Seconds one slot holder (request or run) is in the system: mean and
    /// p95. Default for `model_request`: the profile's measured e2e latency
    /// at the safe point; required for `run`.
    pub time_in_system_s_mean: Option<f64>,
    pub time_in_system_s_p95: Option<f64>,
    /// Other dependencies per run (vector queries, tool writes, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dependencies_per_run: BTreeMap<String, f64>,
    /// Agent-shaped load (`envelope sweep` with `load.workload`): tokens of
    /// the system prompt every call of this class starts with (shared
    /// across runs, so a server's prefix cache can hold it). Counted within
    /// each call's input.
    #[serde(default)]
    pub system_prompt_tokens: u32,
    /// Agent-shaped load: the calls of a run share a growing context: each
    /// prompt is the previous prompt, its output and `tool_result_tokens`,
    /// and `input_tokens_*` describe a run's first call. Off: each call's
    /// input is drawn from `input_tokens_*`, as `envelope plan` counts it.
    #[serde(default)]
    pub session: bool,
    /// Agent-shaped load, sessions: tool-result tokens added between calls.
    #[serde(default)]
    pub tool_result_tokens: u32,
    /// The share of this class's prompt tokens the server is planned to
    /// find in its prefix cache (seed 000's effective uncached input =
    /// total input - cached input). Default 0: every token new.
    pub cache_hit_rate: Option<f64>,
    /// The lowest the hit rate may fall to (a flushed cache, a restart, a
    /// new prompt version): `envelope plan` sizes prefill on the uncached
    /// input at this floor, and shows the capacity at the planned rate
    /// beside it. Default 0: the cache is an optimisation the plan shows,
    /// never one it relies on.
    pub cache_hit_rate_floor: Option<f64>,
    /// Model tiers (`envelope plan --tier`): the model requests each tier
    /// serves per call of this class (0.8 small and 0.2 large; escalated
    /// calls are attempts on both, so the shares may sum above 1). Empty:
    /// the mix given with `--tier-mix`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tiers: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencyBasis {
    #[default]
    ModelRequest,
    Run,
}

impl ConcurrencyBasis {
    pub fn as_str(&self) -> &'static str {
        match self {
            ConcurrencyBasis::ModelRequest => "model_request",
            ConcurrencyBasis::Run => "run",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

impl Workload {
    /// Parses and validates a workload; errors name `path` and the field.
    pub fn from_toml(text: &str, path: &str) -> Result<Workload, WorkloadError> {
        let bad = |m: String| WorkloadError::Invalid {
            path: path.to_string(),
            message: m,
        };
        let w: Workload = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if w.classes.is_empty() {
            return Err(bad(
                "field `class`: at least one [[class]] is required".into()
            ));
        }
        let nonneg = |field: String, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(bad(format!(
                    "field `{field}` must be finite and >= 0, got {v}"
                )))
            }
        };
        let at_least_one = |field: String, v: f64| {
            if v.is_finite() && v >= 1.0 {
                Ok(())
            } else {
                Err(bad(format!("field `{field}` must be >= 1, got {v}")))
            }
        };
        let r = &w.reserves;
        nonneg("reserves.burst".into(), r.burst)?;
        nonneg("reserves.operational".into(), r.operational)?;
        nonneg("reserves.failover".into(), r.failover)?;
        let s = &w.scenarios;
        at_least_one(
            "scenarios.failover_traffic_factor".into(),
            s.failover_traffic_factor,
        )?;
        at_least_one(
            "scenarios.failover_retry_amplification".into(),
            s.failover_retry_amplification,
        )?;
        nonneg(
            "scenarios.recovery_backlog_factor".into(),
            s.recovery_backlog_factor,
        )?;
        let mut names = std::collections::BTreeSet::new();
        for (i, c) in w.classes.iter().enumerate() {
            let f = |n: &str| format!("class[{i}].{n}");
            if c.name.is_empty() || !names.insert(c.name.clone()) {
                return Err(bad(format!(
                    "field `{}` must be non-empty and unique, got `{}`",
                    f("name"),
                    c.name
                )));
            }
            nonneg(f("runs_per_min"), c.runs_per_min)?;
            if let Some(p) = c.runs_per_min_p95 {
                nonneg(f("runs_per_min_p95"), p)?;
                if p < c.runs_per_min {
                    return Err(bad(format!(
                        "field `{}` ({p}) is below `{}` ({})",
                        f("runs_per_min_p95"),
                        f("runs_per_min"),
                        c.runs_per_min
                    )));
                }
            }
            nonneg(f("model_calls_per_run"), c.model_calls_per_run)?;
            at_least_one(f("retry_amplification"), c.retry_amplification)?;
            at_least_one(f("fallback_amplification"), c.fallback_amplification)?;
            for (n, p50, p95, mean) in [
                (
                    "input_tokens",
                    c.input_tokens_p50,
                    c.input_tokens_p95,
                    c.input_tokens_mean,
                ),
                (
                    "output_tokens",
                    c.output_tokens_p50,
                    c.output_tokens_p95,
                    c.output_tokens_mean,
                ),
            ] {
                nonneg(f(&format!("{n}_p50")), p50)?;
                nonneg(f(&format!("{n}_p95")), p95)?;
                if p95 < p50 {
                    return Err(bad(format!(
                        "field `{}` ({p95}) is below `{}` ({p50})",
                        f(&format!("{n}_p95")),
                        f(&format!("{n}_p50"))
                    )));
                }
                if let Some(m) = mean {
                    nonneg(f(&format!("{n}_mean")), m)?;
                }
            }
            for (t, share) in &c.tiers {
                nonneg(f(&format!("tiers.{t}")), *share)?;
            }
            if c.concurrency_basis == ConcurrencyBasis::Run
                && (c.time_in_system_s_mean.is_none() || c.time_in_system_s_p95.is_none())
            {
                return Err(bad(format!(
                    "fields `{}` and `{}` are required with concurrency_basis = \"run\"",
                    f("time_in_system_s_mean"),
                    f("time_in_system_s_p95")
                )));
            }
            for (n, v) in [
                ("time_in_system_s_mean", c.time_in_system_s_mean),
                ("time_in_system_s_p95", c.time_in_system_s_p95),
            ] {
                if let Some(v) = v {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(bad(format!("field `{}` must be > 0, got {v}", f(n))));
                    }
                }
            }
            if let (Some(m), Some(p)) = (c.time_in_system_s_mean, c.time_in_system_s_p95) {
                if p < m {
                    return Err(bad(format!(
                        "field `{}` ({p}) is below `{}` ({m})",
                        f("time_in_system_s_p95"),
                        f("time_in_system_s_mean")
                    )));
                }
            }
            for (k, v) in &c.dependencies_per_run {
                nonneg(f(&format!("dependencies_per_run.{k}")), *v)?;
            }
            for (n, v) in [
                ("cache_hit_rate", c.cache_hit_rate),
                ("cache_hit_rate_floor", c.cache_hit_rate_floor),
            ] {
                if let Some(v) = v.filter(|v| !(0.0..1.0).contains(v)) {
                    return Err(bad(format!("field `{}` must be in [0, 1), got {v}", f(n))));
                }
            }
            if c.cache_hit_rate_floor.unwrap_or(0.0) > c.cache_hit_rate.unwrap_or(0.0) {
                return Err(bad(format!(
                    "field `{}` ({}) is above `{}` ({})",
                    f("cache_hit_rate_floor"),
                    c.cache_hit_rate_floor.unwrap_or(0.0),
                    f("cache_hit_rate"),
                    c.cache_hit_rate.unwrap_or(0.0)
                )));
            }
        }
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "t"
[[class]]
name = "chat"
runs_per_min = 180
model_calls_per_run = 2.4
retry_amplification = 1.08
input_tokens_p50 = 7200
input_tokens_p95 = 9000
output_tokens_p50 = 1200
output_tokens_p95 = 2000
dependencies_per_run = { vector_queries = 3 }
"#;

    #[test]
    fn parses_with_defaults() {
        let w = Workload::from_toml(GOOD, "w.toml").unwrap();
        assert_eq!(w.classes.len(), 1);
        assert_eq!(w.classes[0].fallback_amplification, 1.0);
        assert_eq!(w.reserves, Reserves::default());
        assert_eq!(w.scenarios, ScenarioFactors::default());
        assert_eq!(w.classes[0].dependencies_per_run["vector_queries"], 3.0);
    }

    #[test]
    fn errors_name_file_and_field() {
        let e = |t: &str| Workload::from_toml(t, "w.toml").unwrap_err().to_string();
        let m = e(&GOOD.replace("runs_per_min = 180", "runs_per_min = -1"));
        assert!(
            m.contains("w.toml") && m.contains("class[0].runs_per_min"),
            "{m}"
        );
        let m = e(&GOOD.replace("retry_amplification = 1.08", "retry_amplification = 0.9"));
        assert!(m.contains("class[0].retry_amplification"), "{m}");
        let m = e(&GOOD.replace("input_tokens_p95 = 9000", "input_tokens_p95 = 10"));
        assert!(m.contains("class[0].input_tokens_p95"), "{m}");
        let m = e(&GOOD.replace("model_calls_per_run = 2.4\n", ""));
        assert!(
            m.contains("w.toml") && m.contains("model_calls_per_run"),
            "{m}"
        );
        let m = e(&GOOD.replace("name = \"t\"", "name = \"t\"\nbogus = 1"));
        assert!(m.contains("bogus"), "{m}");
        let m = e("name = \"x\"\nclass = []\n");
        assert!(m.contains("`class`"), "{m}");
        let m = e(&GOOD.replace(
            "name = \"chat\"",
            "name = \"chat\"\nconcurrency_basis = \"run\"",
        ));
        assert!(m.contains("class[0].time_in_system_s_mean"), "{m}");
        let m = e(&format!("{GOOD}\n[reserves]\nburst = -0.1\n"));
        assert!(m.contains("reserves.burst"), "{m}");
    }
}
