//! The service-level objectives of a sweep, as its configuration states
//! them and its profile keeps them: the limits, the headroom, and how a
//! probe's verdict is decided (the confidence and the sequential test's
//! zones).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Service-level objectives a probe must meet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    pub ttft_p95_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
    /// Failed requests allowed, as a share of the admitted ones (a
    /// refusal is not a failure).
    #[serde(default)]
    pub max_error_rate: f64,
    /// Refusals (429 with Retry-After, as a governor answers) allowed, as a
    /// share of the requests sent.
    #[serde(default = "twentieth")]
    pub max_shed_rate: f64,
    #[serde(default = "one")]
    pub max_kv_usage: f64,
    #[serde(default = "yes")]
    pub zero_preemptions: bool,
    /// Fraction taken off the feasible maximum for the safe point.
    #[serde(default = "tenth")]
    pub headroom: f64,
    /// The confidence a probe's latency verdicts are decided at (see
    /// [`crate::confidence`]): each error of the sequential test, calling
    /// a level at `p0` breached or one at `p1` held, at most `1 -
    /// confidence`.
    #[serde(default = "default_confidence")]
    pub confidence: f64,
    /// The zones the sequential test decides between, per percentile. A
    /// sweep always states them in its profile; a profile without them
    /// was decided by the exceedance bound (before 2026-12-06).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<crate::confidence::DecisionRule>,
}

impl Slo {
    /// The sequential test that decides `percentile` at this confidence.
    pub fn test(&self, percentile: f64) -> crate::confidence::SequentialTest {
        self.decision
            .unwrap_or_default()
            .test(percentile, self.confidence)
    }
}

fn default_confidence() -> f64 {
    crate::confidence::DEFAULT_CONFIDENCE
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
fn twentieth() -> f64 {
    0.05
}

impl Default for Slo {
    fn default() -> Self {
        Slo {
            ttft_p95_ms: None,
            itl_p95_ms: None,
            e2e_p99_ms: None,
            max_error_rate: 0.0,
            max_shed_rate: 0.05,
            max_kv_usage: 1.0,
            zero_preemptions: true,
            headroom: 0.1,
            confidence: default_confidence(),
            decision: None,
        }
    }
}
