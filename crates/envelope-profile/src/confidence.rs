//! How sure a measurement is. A probe passes a percentile SLO when the
//! share of its requests over the limit is, at the configured confidence,
//! within what the percentile allows: the one-sided Clopper-Pearson bounds
//! on a binomial rate (the rule MLPerf Inference's LoadGen applies in its
//! early stopping), and from them the fewest requests that can show it.
//! The gate compares per-repeat figures with a Welch interval on their
//! logarithms ([`compare_repeats`]).

use serde::{Deserialize, Serialize};
use statrs::distribution::{Beta, ContinuousCDF, Normal, StudentsT};

/// The confidence asked when a configuration names none.
pub const DEFAULT_CONFIDENCE: f64 = 0.9;

/// The upper bound, at `confidence`, on the true rate of an event seen
/// `k` times in `n` trials: the largest rate under which seeing `k` or
/// fewer is at least `1 - confidence` likely. 1 with no trials.
pub fn rate_upper_bound(k: u64, n: u64, confidence: f64) -> f64 {
    if n == 0 || k >= n {
        return 1.0;
    }
    // Beta(k + 1, n - k) at `confidence` (Clopper-Pearson, one-sided).
    Beta::new(k as f64 + 1.0, (n - k) as f64)
        .map(|b| b.inverse_cdf(confidence))
        .unwrap_or(1.0)
}

/// The lower bound, at `confidence`, on the true rate of an event seen
/// `k` times in `n` trials. 0 when it was never seen.
pub fn rate_lower_bound(k: u64, n: u64, confidence: f64) -> f64 {
    if n == 0 || k == 0 {
        return 0.0;
    }
    if k >= n {
        return (1.0 - confidence).powf(1.0 / n as f64);
    }
    Beta::new(k as f64, (n - k) as f64 + 1.0)
        .map(|b| b.inverse_cdf(1.0 - confidence))
        .unwrap_or(0.0)
}

/// The fewest requests that can show a `percentile` (0.95 for p95) holds
/// at `confidence`: with none over the limit, the upper bound on the share
/// over it falls to `1 - percentile` at n = ln(1 - confidence) / ln(percentile).
pub fn min_requests(percentile: f64, confidence: f64) -> u64 {
    ((1.0 - confidence).ln() / percentile.ln()).ceil().max(1.0) as u64
}

/// What a sample says of a bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Holds at the confidence asked.
    Holds,
    /// Breached at the confidence asked.
    Breached,
    /// The sample cannot tell yet: more requests (or repeats) would.
    Undecided,
}

/// Whether a `percentile` latency SLO holds, from `over` of `n` requests
/// over its limit: it holds when the upper bound on the share over the
/// limit is within `1 - percentile`, is breached when the lower bound is
/// past it, and is undecided between.
pub fn percentile_holds(over: u64, n: u64, percentile: f64, confidence: f64) -> Decision {
    let allowed = 1.0 - percentile;
    if rate_upper_bound(over, n, confidence) <= allowed {
        Decision::Holds
    } else if rate_lower_bound(over, n, confidence) > allowed {
        Decision::Breached
    } else {
        Decision::Undecided
    }
}

/// Per-repeat figures of both sides, compared: the ratio candidate /
/// (factor x baseline) of their geometric means, with its interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RepeatComparison {
    pub decision: Decision,
    /// Candidate over the rule's threshold (`factor` x baseline): above 1
    /// is better for a `>=` rule.
    pub ratio: f64,
    /// The interval of `ratio` at the confidence (one-sided each way);
    /// `None` with under two repeats on a side.
    pub interval: Option<(f64, f64)>,
    /// Inconclusive: about how many repeats a side would decide it.
    pub repeats_needed: Option<u32>,
    /// How it was decided: `interval` (Welch, on the logarithms) or
    /// `noise_floor` (under two repeats on a side).
    pub method: &'static str,
}

fn mean_var(x: &[f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let v = if x.len() > 1 {
        x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (m, v)
}

/// Whether `candidate >= factor x baseline` (`higher_is_better`), or `<=`,
/// holds at `confidence`, from per-repeat values (positive). The rule
/// fails only when the candidate is worse than the threshold at that
/// confidence; it passes when the interval also rules out being worse
/// than it by more than `noise_floor` (a fraction: 0.1 for 10%); else it
/// is inconclusive. With under two repeats on a side there is no
/// interval: decided only when the ratio is past the threshold by more
/// than the noise floor, either way.
pub fn compare_repeats(
    baseline: &[f64],
    candidate: &[f64],
    factor: f64,
    higher_is_better: bool,
    confidence: f64,
    noise_floor: f64,
) -> Option<RepeatComparison> {
    let logs = |x: &[f64]| -> Option<Vec<f64>> {
        x.iter()
            .map(|v| (*v > 0.0 && v.is_finite()).then(|| v.ln()))
            .collect()
    };
    let (b, c) = (logs(baseline)?, logs(candidate)?);
    if b.is_empty() || c.is_empty() || factor <= 0.0 {
        return None;
    }
    let ((mb, vb), (mc, vc)) = (mean_var(&b), mean_var(&c));
    // How far the candidate is above its threshold, in logs; a `<=` rule
    // turns it round so that above 0 is always better.
    let sign = if higher_is_better { 1.0 } else { -1.0 };
    let d = sign * (mc - mb - factor.ln());
    let margin = -(1.0 - noise_floor.clamp(0.0, 0.99)).ln();
    let ratio = (sign * d).exp();
    let to_ratio = |x: f64| (sign * x).exp();
    if b.len() < 2 || c.len() < 2 {
        let decision = if d < -margin {
            Decision::Breached
        } else if d > margin {
            Decision::Holds
        } else {
            Decision::Undecided
        };
        return Some(RepeatComparison {
            decision,
            ratio,
            interval: None,
            repeats_needed: (decision == Decision::Undecided).then_some(3),
            method: "noise_floor",
        });
    }
    let (nb, nc) = (b.len() as f64, c.len() as f64);
    let (sb, sc) = (vb / nb, vc / nc);
    let se = (sb + sc).sqrt();
    // Welch-Satterthwaite degrees of freedom.
    let df = if se > 0.0 {
        (sb + sc).powi(2) / (sb * sb / (nb - 1.0) + sc * sc / (nc - 1.0))
    } else {
        nb + nc - 2.0
    };
    let t = StudentsT::new(0.0, 1.0, df.max(1.0))
        .map(|t| t.inverse_cdf(confidence))
        .unwrap_or(f64::INFINITY);
    let (lo, hi) = (d - t * se, d + t * se);
    let decision = if hi < 0.0 {
        Decision::Breached
    } else if lo >= -margin {
        Decision::Holds
    } else {
        Decision::Undecided
    };
    let repeats_needed = (decision == Decision::Undecided).then(|| {
        // The half-width that would decide it from here: the interval
        // above -margin, or below 0, whichever is nearer.
        let half = (d + margin).max(-d).max(1e-6);
        let z = Normal::new(0.0, 1.0)
            .map(|n| n.inverse_cdf(confidence))
            .unwrap_or(1.3);
        // Var of the difference with n repeats a side: (vb + vc) / n.
        let n = (z / half).powi(2) * (vb + vc);
        (n.ceil() as u32).max(b.len().max(c.len()) as u32 + 1)
    });
    let interval = if higher_is_better {
        (to_ratio(lo), to_ratio(hi))
    } else {
        (to_ratio(hi), to_ratio(lo))
    };
    Some(RepeatComparison {
        decision,
        ratio,
        interval: Some(interval),
        repeats_needed,
        method: "interval",
    })
}

/// Repeats a side the gate's documentation asks for: with run-to-run
/// drift of 8% (CV) and a `>= 0.95 x baseline` rule at 90% confidence,
/// twelve repeats a side tell an unchanged candidate from one 15% slower
/// in at least 95 of 100 trials (`tests::the_gate_tells_drift_from_a_regression`;
/// ten caught the slower one in 94).
pub const GATE_REPEATS: usize = 12;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_distr::{Distribution, LogNormal};

    /// P(X <= k) for X ~ Binomial(n, p), summed term by term.
    fn binomial_cdf(k: u64, n: u64, p: f64) -> f64 {
        let mut term = (1.0 - p).powi(n as i32);
        let mut sum = term;
        for i in 0..k {
            term *= (n - i) as f64 / (i + 1) as f64 * p / (1.0 - p);
            sum += term;
        }
        sum.min(1.0)
    }

    /// The p in (0, 1) where `f` (decreasing in p) crosses `target`, by
    /// bisection: a second way to the bounds, not through the beta
    /// distribution.
    fn solve(f: impl Fn(f64) -> f64, target: f64) -> f64 {
        let (mut lo, mut hi) = (0.0, 1.0);
        for _ in 0..200 {
            let mid = (lo + hi) / 2.0;
            if f(mid) > target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (lo + hi) / 2.0
    }

    #[test]
    fn the_bounds_match_the_binomial_computed_directly() {
        for (k, n) in [
            (0, 10),
            (1, 20),
            (3, 45),
            (5, 100),
            (12, 100),
            (40, 230),
            (9, 10),
        ] {
            for c in [0.9, 0.95, 0.99] {
                let upper = solve(|p| binomial_cdf(k, n, p), 1.0 - c);
                let got = rate_upper_bound(k, n, c);
                assert!(
                    (got - upper).abs() < 1e-6,
                    "upper {k}/{n} at {c}: {got} vs {upper}"
                );
                if k > 0 {
                    // P(X >= k) = 1 - P(X <= k - 1), increasing in p.
                    let lower = solve(|p| binomial_cdf(k - 1, n, p), c);
                    let got = rate_lower_bound(k, n, c);
                    assert!(
                        (got - lower).abs() < 1e-6,
                        "lower {k}/{n} at {c}: {got} vs {lower}"
                    );
                }
            }
        }
        // None seen: the closed form 1 - (1 - c)^(1/n).
        assert!((rate_upper_bound(0, 45, 0.9) - (1.0 - 0.1f64.powf(1.0 / 45.0))).abs() < 1e-9);
        assert_eq!(rate_upper_bound(0, 0, 0.9), 1.0);
        assert_eq!(rate_lower_bound(0, 50, 0.9), 0.0);
    }

    #[test]
    fn the_fewest_requests_follow_from_the_percentile_and_the_confidence() {
        // ln(0.1) / ln(0.95) = 44.9; ln(0.1) / ln(0.99) = 229.1;
        // ln(0.01) / ln(0.9) = 43.7.
        assert_eq!(min_requests(0.95, 0.9), 45);
        assert_eq!(min_requests(0.99, 0.9), 230);
        assert_eq!(min_requests(0.9, 0.99), 44);
        for (p, c) in [(0.95, 0.9), (0.99, 0.9), (0.9, 0.99), (0.5, 0.9)] {
            let n = min_requests(p, c);
            assert_eq!(percentile_holds(0, n, p, c), Decision::Holds, "{p} {c}");
            assert_eq!(
                percentile_holds(0, n - 1, p, c),
                Decision::Undecided,
                "{p} {c}"
            );
        }
    }

    #[test]
    fn a_percentile_holds_is_breached_or_is_undecided() {
        // 1 of 100 over a p95 limit: at most 3.8% at 90%.
        assert_eq!(percentile_holds(1, 100, 0.95, 0.9), Decision::Holds);
        // 12 of 100: at least 7.8%.
        assert_eq!(percentile_holds(12, 100, 0.95, 0.9), Decision::Breached);
        // 5 of 100 is what a p95 allows: it cannot tell.
        assert_eq!(percentile_holds(5, 100, 0.95, 0.9), Decision::Undecided);
        // 1 of 8: too few to call a breach, too many to call it held
        // (1.3% to 38.8%); 2 of 8 is a breach (at least 5.5%).
        assert_eq!(percentile_holds(1, 8, 0.95, 0.9), Decision::Undecided);
        assert_eq!(percentile_holds(2, 8, 0.95, 0.9), Decision::Breached);
        assert_eq!(percentile_holds(8, 8, 0.95, 0.9), Decision::Breached);
    }

    /// `repeats` values a side, lognormal with CV 8% around `mean`.
    fn draws(rng: &mut rand::rngs::StdRng, mean: f64, repeats: usize) -> Vec<f64> {
        let sigma = (1.0f64 + 0.08 * 0.08).ln().sqrt();
        let d = LogNormal::new(mean.ln() - sigma * sigma / 2.0, sigma).unwrap();
        (0..repeats).map(|_| d.sample(rng)).collect()
    }

    fn tally(candidate_mean: f64, repeats: usize) -> [usize; 3] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        let mut out = [0; 3];
        for _ in 0..100 {
            let b = draws(&mut rng, 100.0, repeats);
            let c = draws(&mut rng, candidate_mean, repeats);
            let r = compare_repeats(&b, &c, 0.95, true, DEFAULT_CONFIDENCE, 0.1).unwrap();
            out[r.decision as usize] += 1;
        }
        out
    }

    #[test]
    fn the_gate_tells_drift_from_a_regression() {
        let [holds, breached, undecided] = tally(100.0, GATE_REPEATS);
        assert!(
            holds >= 95,
            "unchanged: {holds} held, {breached} breached, {undecided} undecided"
        );
        let [holds, breached, undecided] = tally(85.0, GATE_REPEATS);
        assert!(
            breached >= 95,
            "15% slower: {holds} held, {breached} breached, {undecided} undecided"
        );
    }

    #[test]
    fn one_repeat_decides_only_past_the_noise_floor() {
        let r = compare_repeats(&[100.0], &[96.0], 0.95, true, 0.9, 0.1).unwrap();
        assert_eq!((r.decision, r.method), (Decision::Undecided, "noise_floor"));
        assert!(r.interval.is_none() && r.repeats_needed.is_some());
        let r = compare_repeats(&[100.0], &[80.0], 0.95, true, 0.9, 0.1).unwrap();
        assert_eq!(r.decision, Decision::Breached);
        let r = compare_repeats(&[100.0], &[120.0], 0.95, true, 0.9, 0.1).unwrap();
        assert_eq!(r.decision, Decision::Holds);
        // A latency rule (`<=`): lower is better.
        let r = compare_repeats(&[100.0], &[130.0], 1.05, false, 0.9, 0.1).unwrap();
        assert_eq!(r.decision, Decision::Breached);
    }

    #[test]
    fn an_inconclusive_comparison_names_the_repeats_that_would_decide_it() {
        // Three repeats a side, the candidate 8% down with 8% spread: not
        // surely worse than 0.95x, not surely within 10% of it.
        let (b, c) = ([100.0, 108.0, 92.0], [92.0, 99.0, 85.0]);
        let r = compare_repeats(&b, &c, 0.95, true, 0.9, 0.1).unwrap();
        assert_eq!(r.decision, Decision::Undecided, "{r:?}");
        let (lo, hi) = r.interval.unwrap();
        assert!(lo < r.ratio && r.ratio < hi, "{r:?}");
        assert!(r.repeats_needed.unwrap() > 3, "{r:?}");
        // Identical sides with no spread: decided exactly.
        let same = [4.0, 4.0, 4.0];
        let r = compare_repeats(&same, &same, 1.0, true, 0.9, 0.1).unwrap();
        assert_eq!(r.decision, Decision::Holds);
        let r = compare_repeats(&same, &[3.0, 3.0, 3.0], 1.0, true, 0.9, 0.1).unwrap();
        assert_eq!(r.decision, Decision::Breached);
    }
}
