//! Gate a change (typically of precision) by comparing a candidate profile
//! with a baseline: are the two comparable (same node, same model apart from
//! precision, same buckets), what moved per bucket, and does each rule pass.
//! Pure: parsing rules, comparing and rendering Markdown; the CLI does I/O
//! and maps the verdict to an exit code (0 pass, 1 fail, 2 unusable,
//! 3 inconclusive: per-repeat figures that cannot tell a change from noise).

use crate::{ConfigResult, Profile};
use serde::Serialize;

mod comparable;
mod measure;
mod render;
mod rules;

pub use comparable::{fingerprint_differences, Difference};
pub use render::markdown;
pub use rules::{
    evaluate, GateRules, Op, Rule, RulesError, Scope, DEFAULT_NOISE_FLOOR, DEFAULT_RULES, METRICS,
};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricDelta {
    pub metric: String,
    pub unit: String,
    pub baseline: Option<f64>,
    pub candidate: Option<f64>,
    /// (candidate - baseline) / baseline, percent.
    pub delta_pct: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketComparison {
    pub bucket: String,
    /// Which probe each side's figures come from.
    pub baseline_probe: String,
    pub candidate_probe: String,
    pub metrics: Vec<MetricDelta>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleStatus {
    Pass,
    Fail,
    /// The metric was not measured on one side: counts as a failure.
    Missing,
    /// The per-repeat figures cannot tell a change from noise at the
    /// confidence asked: more repeats would.
    Inconclusive,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleResult {
    pub rule: String,
    /// The bucket (`INPUTxOUTPUT`) for per-bucket metrics.
    pub bucket: Option<String>,
    pub baseline: Option<f64>,
    pub candidate: Option<f64>,
    pub threshold: Option<f64>,
    pub status: RuleStatus,
    /// How it was decided: `point` (one figure a side against the
    /// threshold), `interval` (per-repeat figures, a Welch interval at the
    /// rules' confidence), `noise_floor` (one repeat a side: decided
    /// only past the noise floor) or `safe_interval` (safe concurrency,
    /// one search a side: the intervals the sweeps decided it within).
    pub method: &'static str,
    /// Candidate over the threshold (per-repeat methods): above 1 is
    /// better for `>=`, below 1 for `<=`; with its interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval: Option<(f64, f64)>,
    /// Repeats compared (baseline, candidate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeats: Option<(usize, usize)>,
    /// Inconclusive: about how many repeats a side would decide it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeats_needed: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    Unusable,
    /// No rule failed, but at least one cannot tell a change from noise.
    Inconclusive,
}

impl Verdict {
    pub fn exit_code(&self) -> i32 {
        match self {
            Verdict::Pass => 0,
            Verdict::Fail => 1,
            Verdict::Unusable => 2,
            Verdict::Inconclusive => 3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub config: String,
    pub precision: String,
    pub kv_dtype: String,
    pub batch_policy: String,
    pub quality_reference: Option<String>,
}

impl Side {
    fn of(p: &Profile, c: &ConfigResult) -> Side {
        Side {
            config: c.name.clone(),
            precision: c.precision.clone(),
            kv_dtype: c.kv_dtype.clone(),
            batch_policy: c.batch_policy.clone(),
            quality_reference: p
                .quality
                .as_ref()
                .and_then(|q| q.reference_precision.clone()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateReport {
    pub verdict: Verdict,
    pub comparable: bool,
    /// Why the inputs cannot be gated (empty when comparable).
    pub unusable_reasons: Vec<String>,
    pub baseline: Option<Side>,
    pub candidate: Option<Side>,
    pub differences: Vec<Difference>,
    pub config_metrics: Vec<MetricDelta>,
    pub quality_metrics: Vec<MetricDelta>,
    pub buckets: Vec<BucketComparison>,
    pub rules: Vec<RuleResult>,
    /// The rules' confidence and noise floor (fractions).
    pub confidence: f64,
    pub noise_floor: f64,
}

fn bucket_name(k: (u32, u32)) -> String {
    format!("{}x{}", k.0, k.1)
}

/// Compares `candidate` with `baseline` under `rules`: comparability first
/// (an unusable pair is reported with every reason), then the figures of
/// both sides, then each rule on them.
pub fn gate(baseline: &Profile, candidate: &Profile, rules: &GateRules) -> GateReport {
    let differences = fingerprint_differences(
        &baseline.fingerprint,
        &candidate.fingerprint,
        &rules.allow_differences,
    );
    let mut unusable: Vec<String> = differences
        .iter()
        .filter(|d| d.kind == "blocking")
        .map(|d| {
            format!(
                "fingerprint field `{}` differs: baseline {}, candidate {}",
                d.field, d.baseline, d.candidate
            )
        })
        .collect();
    let bc = comparable::config(baseline, rules.baseline_config.as_deref())
        .map_err(|e| format!("baseline: {e}"));
    let cc = comparable::config(candidate, rules.candidate_config.as_deref())
        .map_err(|e| format!("candidate: {e}"));
    let mut report = GateReport {
        verdict: Verdict::Unusable,
        comparable: false,
        unusable_reasons: vec![],
        baseline: bc.as_ref().ok().map(|c| Side::of(baseline, c)),
        candidate: cc.as_ref().ok().map(|c| Side::of(candidate, c)),
        differences,
        config_metrics: vec![],
        quality_metrics: vec![],
        buckets: vec![],
        rules: vec![],
        confidence: rules.confidence,
        noise_floor: rules.noise_floor,
    };
    let (bc, cc) = match (bc, cc) {
        (Ok(b), Ok(c)) => (b, c),
        (b, c) => {
            unusable.extend(b.err());
            unusable.extend(c.err());
            report.unusable_reasons = unusable;
            return report;
        }
    };
    let (blocking, notes) = comparable::check(baseline, candidate, bc, cc);
    unusable.extend(blocking);
    report.differences.extend(notes);
    let measured = measure::compare(baseline, candidate, bc, cc);
    report.rules = measure::rule_results(rules, &measured, baseline, candidate, bc, cc);
    report.config_metrics = measured.config;
    report.quality_metrics = measured.quality;
    report.buckets = measured.buckets;
    report.comparable = unusable.is_empty();
    let any = |s: RuleStatus| report.rules.iter().any(|r| r.status == s);
    report.verdict = if !unusable.is_empty() {
        Verdict::Unusable
    } else if any(RuleStatus::Fail) || any(RuleStatus::Missing) {
        Verdict::Fail
    } else if any(RuleStatus::Inconclusive) {
        Verdict::Inconclusive
    } else {
        Verdict::Pass
    };
    report.unusable_reasons = unusable;
    report
}

#[cfg(test)]
mod tests;
