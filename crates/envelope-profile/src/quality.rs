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
