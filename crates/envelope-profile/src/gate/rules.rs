//! Gate rules: `METRIC OP NUMBER [x baseline]`, the metrics they may name,
//! the rules file, and evaluating one rule on a pair of measured values.

use super::RuleStatus;
use serde::{Deserialize, Serialize};

/// The rules used when no file is given (`bench-configs/gates/precision.toml`).
pub const DEFAULT_RULES: &str = r#"
rules = [
  "safe_concurrency >= 1.0 x baseline",
  "decode_tok_s >= 0.95 x baseline",
  "kl_divergence <= 0.02",
  "top1_agreement >= 0.97",
]
"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Op {
    #[serde(rename = ">=")]
    Ge,
    #[serde(rename = "<=")]
    Le,
    #[serde(rename = ">")]
    Gt,
    #[serde(rename = "<")]
    Lt,
}

impl Op {
    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            ">=" => Op::Ge,
            "<=" => Op::Le,
            ">" => Op::Gt,
            "<" => Op::Lt,
            _ => return None,
        })
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            Op::Ge => ">=",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Lt => "<",
        }
    }
    /// `a OP b`; `>=` and `<=` allow 1e-9 relative slack, so a threshold
    /// such as 0.95 x 100 (94.99999999999999) does not fail 95.
    pub fn holds(&self, a: f64, b: f64) -> bool {
        let eps = 1e-9 * b.abs();
        match self {
            Op::Ge => a >= b - eps,
            Op::Le => a <= b + eps,
            Op::Gt => a > b,
            Op::Lt => a < b,
        }
    }
}

/// Where a metric lives: per bucket, per configuration, or in the quality section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    Bucket,
    Config,
    Quality,
}

/// Every metric a rule may name: (name, scope, unit).
pub const METRICS: &[(&str, Scope, &str)] = &[
    ("safe_concurrency", Scope::Bucket, "seqs"),
    ("decode_tok_s", Scope::Bucket, "tok/s"),
    ("prefill_tok_s", Scope::Bucket, "tok/s"),
    ("output_tok_s", Scope::Bucket, "tok/s"),
    ("ttft_p50_ms", Scope::Bucket, "ms"),
    ("ttft_p95_ms", Scope::Bucket, "ms"),
    ("ttft_p99_ms", Scope::Bucket, "ms"),
    ("itl_p50_ms", Scope::Bucket, "ms"),
    ("itl_p95_ms", Scope::Bucket, "ms"),
    ("itl_p99_ms", Scope::Bucket, "ms"),
    ("e2e_p95_ms", Scope::Bucket, "ms"),
    ("weight_bytes", Scope::Config, "bytes"),
    ("kv_capacity_tokens", Scope::Config, "tokens"),
    ("peak_bytes", Scope::Config, "bytes"),
    ("perplexity", Scope::Quality, ""),
    ("kl_divergence", Scope::Quality, "nats"),
    ("kl_divergence_p95", Scope::Quality, "nats"),
    ("top1_agreement", Scope::Quality, "fraction"),
];

pub(super) fn metric_info(name: &str) -> Option<(Scope, &'static str)> {
    METRICS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, s, u)| (*s, *u))
}

/// `METRIC OP NUMBER` (an absolute bound on the candidate) or
/// `METRIC OP NUMBER x baseline` (a bound relative to the baseline).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rule {
    pub text: String,
    pub metric: String,
    pub op: Op,
    pub number: f64,
    pub relative_to_baseline: bool,
}

impl Rule {
    pub fn parse(text: &str) -> Result<Rule, String> {
        let t: Vec<&str> = text.split_whitespace().collect();
        let shape = "expected `METRIC OP NUMBER` or `METRIC OP NUMBER x baseline`";
        let (metric, op, number, rel) = match t.as_slice() {
            [m, o, n] => (m, o, n, false),
            [m, o, n, x, b] if matches!(*x, "x" | "*" | "×") && *b == "baseline" => {
                (m, o, n, true)
            }
            _ => return Err(format!("`{text}`: {shape}")),
        };
        if metric_info(metric).is_none() {
            let all: Vec<&str> = METRICS.iter().map(|m| m.0).collect();
            return Err(format!(
                "`{text}`: unknown metric `{metric}` (one of {})",
                all.join(", ")
            ));
        }
        let op = Op::parse(op)
            .ok_or_else(|| format!("`{text}`: operator `{op}` is not >=, <=, > or <"))?;
        let number: f64 = number
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite())
            .ok_or_else(|| format!("`{text}`: `{number}` is not a number"))?;
        Ok(Rule {
            text: t.join(" "),
            metric: metric.to_string(),
            op,
            number,
            relative_to_baseline: rel,
        })
    }
}

/// The rules file (`bench-configs/gates/*.toml`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    rules: Vec<String>,
    #[serde(default)]
    allow_differences: Vec<String>,
    baseline_config: Option<String>,
    candidate_config: Option<String>,
    confidence: Option<f64>,
    noise_floor: Option<f64>,
}

/// The noise floor when a rules file names none: a relative rule on one
/// repeat a side is decided only past 10%.
pub const DEFAULT_NOISE_FLOOR: f64 = 0.1;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateRules {
    pub rules: Vec<Rule>,
    /// Fingerprint fields (prefixes, e.g. `node.host.cpu_model`) whose
    /// differences are reported but do not make the profiles incomparable.
    pub allow_differences: Vec<String>,
    /// Configurations to compare (default: each profile's `selected`).
    pub baseline_config: Option<String>,
    pub candidate_config: Option<String>,
    /// How sure a relative rule on per-repeat figures must be to fail or
    /// pass (default [`crate::confidence::DEFAULT_CONFIDENCE`]).
    pub confidence: f64,
    /// The run-to-run drift below which a relative rule cannot tell a
    /// change from noise, as a fraction (default [`DEFAULT_NOISE_FLOOR`]).
    pub noise_floor: f64,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct RulesError {
    pub path: String,
    pub message: String,
}

impl GateRules {
    pub fn from_toml(text: &str, path: &str) -> Result<GateRules, RulesError> {
        let bad = |m: String| RulesError {
            path: path.into(),
            message: m,
        };
        let f: RulesFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
        if f.rules.is_empty() {
            return Err(bad("field `rules`: at least one rule is required".into()));
        }
        let rules = f
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| Rule::parse(r).map_err(|m| bad(format!("field `rules[{i}]`: {m}"))))
            .collect::<Result<_, _>>()?;
        let confidence = f
            .confidence
            .unwrap_or(crate::confidence::DEFAULT_CONFIDENCE);
        if !(0.5..1.0).contains(&confidence) {
            return Err(bad(format!(
                "field `confidence`: {confidence} is not in [0.5, 1)"
            )));
        }
        let noise_floor = f.noise_floor.unwrap_or(DEFAULT_NOISE_FLOOR);
        if !(0.0..1.0).contains(&noise_floor) {
            return Err(bad(format!(
                "field `noise_floor`: {noise_floor} is not in [0, 1)"
            )));
        }
        Ok(GateRules {
            rules,
            allow_differences: f.allow_differences,
            baseline_config: f.baseline_config,
            candidate_config: f.candidate_config,
            confidence,
            noise_floor,
        })
    }

    pub fn default_rules() -> GateRules {
        GateRules::from_toml(DEFAULT_RULES, "default rules").expect("the default rules parse")
    }
}

/// Evaluates one rule on one pair of measured values.
pub fn evaluate(
    rule: &Rule,
    baseline: Option<f64>,
    candidate: Option<f64>,
) -> (Option<f64>, RuleStatus) {
    let threshold = if rule.relative_to_baseline {
        baseline.map(|b| rule.number * b)
    } else {
        Some(rule.number)
    };
    match (threshold, candidate) {
        (Some(t), Some(c)) if c.is_finite() => (
            Some(t),
            if rule.op.holds(c, t) {
                RuleStatus::Pass
            } else {
                RuleStatus::Fail
            },
        ),
        _ => (threshold, RuleStatus::Missing),
    }
}
