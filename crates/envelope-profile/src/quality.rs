//! The quality section of a profile: how far a precision's next-token
//! distributions are from a reference precision's on a fixed text set.
//! `envelope quality` (envelope-harness) measures it; the gate compares it.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct QualityReport {
    /// The model spec as given (file, directory or `dummy:`).
    pub model: String,
    /// The precision measured.
    pub precision: String,
    /// The precision compared against (`None`: perplexity only).
    pub reference_precision: Option<String>,
    /// Name of the text set (e.g. `bench-configs/quality/text.txt`).
    pub text_set: String,
    pub text_bytes: u64,
    /// Tokens per window; each window starts from an empty cache.
    pub window_tokens: u32,
    pub windows: u32,
    /// Next-token predictions scored (every window position but the last).
    pub tokens_scored: u64,
    /// exp(mean negative log-likelihood) of the measured precision.
    pub perplexity: f64,
    /// Mean negative log-likelihood, nats per token.
    pub mean_nll_nats: f64,
    pub reference_perplexity: Option<f64>,
    /// Mean over positions of KL(reference || measured), nats.
    pub kl_divergence_mean: Option<f64>,
    /// 95th percentile of the per-position KL, nats.
    pub kl_divergence_p95: Option<f64>,
    /// Fraction of positions whose argmax token equals the reference's.
    pub top1_agreement: Option<f64>,
    pub duration_s: f64,
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

impl QualityReport {
    /// The report as `envelope quality` prints it: a row per figure, with
    /// its unit.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let q = self;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "quality of {} at {} against {} on {} ({} bytes)",
            q.model,
            q.precision,
            q.reference_precision.as_deref().unwrap_or("no reference"),
            q.text_set,
            q.text_bytes
        );
        let rows = [
            (
                "windows x tokens",
                format!("{} x {}", q.windows, q.window_tokens),
                "",
            ),
            ("tokens scored", q.tokens_scored.to_string(), "tokens"),
            ("perplexity", format!("{:.4}", q.perplexity), ""),
            ("mean NLL", format!("{:.5}", q.mean_nll_nats), "nats/token"),
            ("reference perplexity", opt(q.reference_perplexity, 4), ""),
            (
                "KL(reference || measured) mean",
                opt(q.kl_divergence_mean, 6),
                "nats",
            ),
            ("KL p95", opt(q.kl_divergence_p95, 6), "nats"),
            ("top-1 agreement", opt(q.top1_agreement, 4), "fraction"),
            ("time", format!("{:.1}", q.duration_s), "s"),
        ];
        for (k, v, u) in rows {
            let _ = writeln!(o, "  {k:<32} {v:>14} {u}");
        }
        o
    }
}
