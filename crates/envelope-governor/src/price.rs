//! Prices under a versioned contract: cost units per million tokens of
//! each kind, or per GPU-second from a profile's throughput at its safe
//! point. Shared by model tiers (cost per call) and budgets (cost per day).

use envelope_profile::Profile;
use serde::Deserialize;

/// Token use as the upstream reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt: u64,
    pub completion: u64,
    /// Prompt tokens served from the upstream's prefix cache.
    pub cached: u64,
}

/// Cost units per call: per million tokens of each kind, or per
/// GPU-second (a call's tokens over the profile's throughput at the safe
/// point).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    #[serde(default)]
    pub input_per_mtok: Option<f64>,
    #[serde(default)]
    pub cached_input_per_mtok: Option<f64>,
    #[serde(default)]
    pub output_per_mtok: Option<f64>,
    #[serde(default)]
    pub gpu_second: Option<f64>,
}

impl PriceConfig {
    /// Checks one price contract; `at` names it in the message
    /// (`tiers.fast.price`, `b.toml: price`).
    ///
    /// # Errors
    /// A negative or non-finite number, per-token prices mixed with
    /// `gpu_second` (two contracts), or no price at all.
    pub fn check(&self, at: &str) -> Result<(), String> {
        let per_token = [
            ("input_per_mtok", self.input_per_mtok),
            ("cached_input_per_mtok", self.cached_input_per_mtok),
            ("output_per_mtok", self.output_per_mtok),
        ];
        for (k, v) in per_token.iter().chain([&("gpu_second", self.gpu_second)]) {
            if v.is_some_and(|v| !v.is_finite() || v < 0.0) {
                return Err(format!("{at}.{k}: must be a finite number >= 0"));
            }
        }
        match (per_token.iter().any(|(_, v)| v.is_some()), self.gpu_second) {
            (true, Some(_)) => Err(format!(
                "{at}: per-token prices and gpu_second are two contracts; give one"
            )),
            (false, None) => Err(format!(
                "{at}: sets no price: give input_per_mtok and output_per_mtok, or gpu_second"
            )),
            _ => Ok(()),
        }
    }
}

/// A tier's price, ready to apply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Price {
    Free,
    /// Cost units per million tokens.
    Tokens {
        input: f64,
        cached_input: f64,
        output: f64,
    },
    /// Cost units per GPU-second; the node serves `tok_per_s` tokens a
    /// second at its safe point.
    GpuSecond {
        price: f64,
        tok_per_s: f64,
    },
}

/// The node's tokens per second at its safe point: the mean over the
/// selected configuration's buckets of the total throughput measured at
/// the largest feasible concurrency.
pub fn safe_point_tok_per_s(p: &Profile) -> Option<f64> {
    let c = p.configs.iter().find(|c| c.name == p.selected)?;
    let rates: Vec<f64> = c
        .buckets
        .iter()
        .filter_map(|b| b.at_feasible.as_ref())
        .map(|s| s.total_tok_per_s)
        .filter(|r| r.is_finite() && *r > 0.0)
        .collect();
    (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
}

impl Price {
    /// The price of `spec` for an upstream with `profile`.
    ///
    /// # Errors
    /// A GPU-second price for a profile that measured no throughput.
    pub fn new(spec: Option<&PriceConfig>, profile: &Profile) -> Result<Price, String> {
        let Some(s) = spec else {
            return Ok(Price::Free);
        };
        if let Some(price) = s.gpu_second {
            let tok_per_s = safe_point_tok_per_s(profile).ok_or_else(|| {
                format!(
                    "gpu_second: the profile {} has no throughput measured at its safe point",
                    profile.selected
                )
            })?;
            return Ok(Price::GpuSecond { price, tok_per_s });
        }
        let input = s.input_per_mtok.unwrap_or(0.0);
        Ok(Price::Tokens {
            input,
            cached_input: s.cached_input_per_mtok.unwrap_or(input),
            output: s.output_per_mtok.unwrap_or(0.0),
        })
    }

    /// The cost of one attempt that used `u`.
    pub fn cost(&self, u: Usage) -> f64 {
        match *self {
            Price::Free => 0.0,
            Price::Tokens {
                input,
                cached_input,
                output,
            } => {
                let cached = u.cached.min(u.prompt);
                ((u.prompt - cached) as f64 * input
                    + cached as f64 * cached_input
                    + u.completion as f64 * output)
                    / 1e6
            }
            Price::GpuSecond { price, tok_per_s } => {
                (u.prompt + u.completion) as f64 / tok_per_s * price
            }
        }
    }
}
