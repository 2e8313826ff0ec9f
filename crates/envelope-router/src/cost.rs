//! Cost attribution: a call's cost on a tier under the versioned price
//! contract (per million tokens of each kind, or per GPU-second from the
//! profile's throughput at the safe point), the book of calls, tokens,
//! cost, escalations and latency per feature and tier, and the features
//! whose mean cost per call is over their allowance.

use super::config::FeatureConfig;
pub use envelope_governor::price::{safe_point_tok_per_s, Price};
use serde::Serialize;
use std::collections::BTreeMap;

/// One row of the book: what a feature spent on a tier.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Row {
    /// Calls answered from this tier (an escalated call counts on the tier
    /// that gave the final answer).
    pub calls: u64,
    /// Attempts made on this tier (including those escalated away).
    pub attempts: u64,
    pub escalations: u64,
    pub fallbacks: u64,
    pub cache_hits: u64,
    pub refusals: u64,
    /// Shadow calls made on this tier, and what they cost (calibration
    /// spend: not in `cost`, not in the cost per call).
    pub shadows: u64,
    pub shadow_cost: f64,
    pub input_tokens: u64,
    pub cached_input_tokens: u64,
    pub output_tokens: u64,
    pub cost: f64,
    pub latency_ms_sum: f64,
}

/// Calls, tokens and cost per (feature, tier).
#[derive(Debug, Default)]
pub struct Book {
    rows: BTreeMap<(String, String), Row>,
    /// Features booked under their own name; past the bound, others book
    /// as `_other` (the features the tiers file names always keep theirs).
    features: std::collections::BTreeSet<String>,
}

/// Features tracked by name at most (labels are bounded).
pub const MAX_FEATURES: usize = 256;
/// The feature of calls without `x-envelope-feature`.
pub const NO_FEATURE: &str = "_none";
/// Features past [`MAX_FEATURES`].
pub const OTHER_FEATURE: &str = "_other";

impl Book {
    /// The label `feature` is booked under; `named` are the features the
    /// configuration names (never folded into `_other`).
    pub fn feature_label(&mut self, feature: &str, named: bool) -> String {
        if named || self.features.contains(feature) {
            return feature.to_string();
        }
        if self.features.len() >= MAX_FEATURES {
            return OTHER_FEATURE.to_string();
        }
        self.features.insert(feature.to_string());
        feature.to_string()
    }

    pub fn row(&mut self, feature: &str, tier: &str) -> &mut Row {
        self.rows
            .entry((feature.to_string(), tier.to_string()))
            .or_default()
    }

    pub fn rows(&self) -> impl Iterator<Item = (&(String, String), &Row)> {
        self.rows.iter()
    }

    /// Mean cost per answered call of each feature, all tiers together.
    pub fn cost_per_call(&self) -> BTreeMap<String, f64> {
        let mut sums: BTreeMap<String, (f64, u64)> = BTreeMap::new();
        for ((f, _), r) in &self.rows {
            let e = sums.entry(f.clone()).or_default();
            e.0 += r.cost;
            e.1 += r.calls;
        }
        sums.into_iter()
            .filter(|(_, (_, n))| *n > 0)
            .map(|(f, (c, n))| (f, c / n as f64))
            .collect()
    }

    /// Features whose mean cost per call is over their allowance:
    /// (feature, cost per call, allowed).
    pub fn over_budget(
        &self,
        allowed: &BTreeMap<String, FeatureConfig>,
    ) -> Vec<(String, f64, f64)> {
        self.cost_per_call()
            .into_iter()
            .filter_map(|(f, c)| {
                let a = allowed.get(&f)?.max_cost_per_call;
                (c > a).then_some((f, c, a))
            })
            .collect()
    }

    /// The book as CSV, a row per feature and tier.
    pub fn csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        let mut put = |fields: &[&str]| {
            // Into a Vec: nothing to fail but the CSV itself, which the
            // crate writes for any text.
            let _ = w.write_record(fields);
        };
        put(&[
            "feature",
            "tier",
            "calls",
            "attempts",
            "escalations",
            "fallbacks",
            "cache_hits",
            "refusals",
            "shadows",
            "shadow_cost",
            "input_tokens",
            "cached_input_tokens",
            "output_tokens",
            "cost",
            "mean_latency_ms",
        ]);
        for ((f, t), r) in &self.rows {
            let mean = if r.calls > 0 {
                r.latency_ms_sum / r.calls as f64
            } else {
                0.0
            };
            put(&[
                f,
                t,
                &r.calls.to_string(),
                &r.attempts.to_string(),
                &r.escalations.to_string(),
                &r.fallbacks.to_string(),
                &r.cache_hits.to_string(),
                &r.refusals.to_string(),
                &r.shadows.to_string(),
                &format!("{:.9}", r.shadow_cost),
                &r.input_tokens.to_string(),
                &r.cached_input_tokens.to_string(),
                &r.output_tokens.to_string(),
                &format!("{:.9}", r.cost),
                &format!("{mean:.1}"),
            ]);
        }
        let bytes = w.into_inner().unwrap_or_default();
        String::from_utf8(bytes).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envelope_governor::price::{PriceConfig, Usage};
    use envelope_profile::Profile;

    #[test]
    fn token_prices_charge_each_kind() {
        let p = Price::Tokens {
            input: 1.0,
            cached_input: 0.25,
            output: 4.0,
        };
        let u = Usage {
            prompt: 1_000_000,
            completion: 500_000,
            cached: 400_000,
        };
        // 600k at 1.0 + 400k at 0.25 + 500k at 4.0, per million.
        assert!((p.cost(u) - (0.6 + 0.1 + 2.0)).abs() < 1e-12);
        let g = Price::GpuSecond {
            price: 2.0,
            tok_per_s: 100.0,
        };
        assert!(
            (g.cost(Usage {
                prompt: 30,
                completion: 20,
                cached: 0
            }) - 1.0)
                .abs()
                < 1e-12
        );
        assert_eq!(Price::Free.cost(u), 0.0);
    }

    #[test]
    fn gpu_seconds_use_the_profiles_safe_point_throughput() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/quickstart-profile-542d032.json"
        ))
        .unwrap();
        let p = Profile::from_json(&text, "quickstart").unwrap();
        // The selected q8_0 configuration's three buckets, at their
        // feasible probes: 399.47, 373.29 and 376.56 tok/s.
        let rate = safe_point_tok_per_s(&p).unwrap();
        assert!((rate - 383.105).abs() < 0.01, "{rate}");
        let spec = PriceConfig {
            input_per_mtok: None,
            cached_input_per_mtok: None,
            output_per_mtok: None,
            gpu_second: Some(2.0),
        };
        let price = Price::new(Some(&spec), &p).unwrap();
        let u = Usage {
            prompt: 300,
            completion: 83,
            cached: 0,
        };
        assert!((price.cost(u) - 383.0 / rate * 2.0).abs() < 1e-12);
        let mut bare = p.clone();
        bare.configs.clear();
        assert!(Price::new(Some(&spec), &bare)
            .unwrap_err()
            .contains("gpu_second"));
        assert_eq!(Price::new(None, &bare).unwrap(), Price::Free);
    }

    #[test]
    fn features_over_their_allowance_are_listed() {
        let mut b = Book::default();
        for (f, t, calls, cost) in [
            ("sum", "small", 4, 0.4),
            ("sum", "large", 1, 0.6),
            ("plan", "large", 2, 0.1),
        ] {
            let r = b.row(f, t);
            r.calls += calls;
            r.cost += cost;
        }
        let per = b.cost_per_call();
        assert!((per["sum"] - 0.2).abs() < 1e-12);
        let allowed: BTreeMap<String, FeatureConfig> = [
            (
                "sum".to_string(),
                FeatureConfig {
                    max_cost_per_call: 0.15,
                },
            ),
            (
                "plan".to_string(),
                FeatureConfig {
                    max_cost_per_call: 0.15,
                },
            ),
        ]
        .into();
        let over = b.over_budget(&allowed);
        assert_eq!(over.len(), 1);
        assert_eq!(over[0].0, "sum");
        assert!(b.csv().lines().count() == 4);
    }

    #[test]
    fn feature_labels_are_bounded() {
        let mut b = Book::default();
        for i in 0..MAX_FEATURES {
            let l = b.feature_label(&format!("f{i}"), false);
            b.row(&l, "t");
        }
        assert_eq!(b.feature_label("f0", false), "f0");
        assert_eq!(b.feature_label("new", false), OTHER_FEATURE);
        assert_eq!(b.feature_label("configured", true), "configured");
    }
}
