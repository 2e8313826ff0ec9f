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
/// over its limit, by the exceedance bound (the rule before
/// [`SequentialTest`], kept to compare with it): it holds when the upper
/// bound on the share over the limit is within `1 - percentile`, is
/// breached when the lower bound is past it, and is undecided between.
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

/// The zone between a percentile SLO that holds and one that is breached,
/// as shares of the requests over its limit: at most `p0` over, it holds;
/// at least `p1` over, it is breached; between, either answer is right.
/// A zone is what lets a sequential test decide a level whose true share
/// sits at the limit, which an exceedance bound never can.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ShareZone {
    pub p0: f64,
    pub p1: f64,
}

/// How a level's percentile SLOs are decided: Wald's sequential
/// probability ratio test between "the share over the limit is `p0`" and
/// "it is `p1`", each error at most `1 - confidence` (see
/// [`SequentialTest`]). The zones, per percentile, are stated in the
/// profile; docs/sweep.md says why these defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DecisionRule {
    /// TTFT and ITL p95: holds at 5% over, breached at 10%.
    #[serde(default = "p95_zone")]
    pub p95: ShareZone,
    /// End-to-end p99: holds at 1% over, breached at 3%.
    #[serde(default = "p99_zone")]
    pub p99: ShareZone,
}

fn p95_zone() -> ShareZone {
    ShareZone { p0: 0.05, p1: 0.10 }
}

fn p99_zone() -> ShareZone {
    ShareZone { p0: 0.01, p1: 0.03 }
}

impl Default for DecisionRule {
    fn default() -> Self {
        DecisionRule {
            p95: p95_zone(),
            p99: p99_zone(),
        }
    }
}

impl DecisionRule {
    /// The zone of a `percentile` (0.95 or 0.99); another percentile gets
    /// one from its allowed share to twice it.
    pub fn zone(&self, percentile: f64) -> ShareZone {
        if (percentile - 0.95).abs() < 1e-9 {
            self.p95
        } else if (percentile - 0.99).abs() < 1e-9 {
            self.p99
        } else {
            let allowed = 1.0 - percentile;
            ShareZone {
                p0: allowed,
                p1: (2.0 * allowed).min(1.0),
            }
        }
    }

    /// Each zone within (0, 1) with `p0 < p1`: the field that is not.
    pub fn check(&self) -> Result<(), String> {
        for (name, z) in [("p95", self.p95), ("p99", self.p99)] {
            if !(z.p0 > 0.0 && z.p0 < z.p1 && z.p1 < 1.0) {
                return Err(format!(
                    "slo.decision.{name} must have 0 < p0 < p1 < 1, got p0 = {}, p1 = {}",
                    z.p0, z.p1
                ));
            }
        }
        Ok(())
    }

    /// The test that decides `percentile` at `confidence`.
    pub fn test(&self, percentile: f64, confidence: f64) -> SequentialTest {
        SequentialTest::new(self.zone(percentile), confidence)
    }
}

/// Wald's sequential probability ratio test on the requests over a limit:
/// each request over it adds `ln(p1 / p0)` to the evidence for a breach,
/// each under it `ln((1 - p1) / (1 - p0))` (negative); the level is
/// breached once the sum reaches `ln(c / (1 - c))` and holds once it falls
/// to `-ln(c / (1 - c))`, so that a level at `p0` is called breached, and
/// one at `p1` held, each at most about `1 - c` of the time. The expected
/// number of requests is bounded at every true share (largest between
/// `p0` and `p1`), where an exceedance bound at the limit spends its whole
/// budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SequentialTest {
    over_step: f64,
    under_step: f64,
    breach_at: f64,
}

impl SequentialTest {
    pub fn new(zone: ShareZone, confidence: f64) -> Self {
        let c = confidence.clamp(0.5 + 1e-9, 1.0 - 1e-9);
        SequentialTest {
            over_step: (zone.p1 / zone.p0).ln(),
            under_step: ((1.0 - zone.p1) / (1.0 - zone.p0)).ln(),
            breach_at: (c / (1.0 - c)).ln(),
        }
    }

    /// The evidence for a breach after `over` of `n` requests over.
    fn evidence(&self, over: u64, n: u64) -> f64 {
        over as f64 * self.over_step + n.saturating_sub(over) as f64 * self.under_step
    }

    /// The decision after `over` of `n` requests over the limit.
    pub fn decide(&self, over: u64, n: u64) -> Decision {
        let e = self.evidence(over, n);
        if e >= self.breach_at - 1e-12 {
            Decision::Breached
        } else if e <= -self.breach_at + 1e-12 {
            Decision::Holds
        } else {
            Decision::Undecided
        }
    }

    /// The fewest more requests, none of them over, after which the level
    /// holds: 0 when it already does.
    pub fn requests_to_hold(&self, over: u64, n: u64) -> u64 {
        let short = self.evidence(over, n) + self.breach_at;
        if short <= 1e-12 {
            return 0;
        }
        (short / -self.under_step - 1e-9).ceil().max(0.0) as u64
    }

    /// The fewest requests that can show the level holds (none over): 41
    /// for a p95 at 90% with the default zone, 108 for a p99.
    pub fn min_requests(&self) -> u64 {
        self.requests_to_hold(0, 0).max(1)
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

    /// One simulated level at a true share `share` over the limit, decided
    /// request by request by `decide` until it answers or `budget` runs
    /// out: the decision and the requests it took.
    fn simulate(
        rng: &mut rand::rngs::StdRng,
        share: f64,
        budget: u64,
        decide: &dyn Fn(u64, u64) -> Decision,
    ) -> (Decision, u64) {
        use rand::Rng;
        let mut over = 0;
        for n in 1..=budget {
            over += u64::from(rng.random::<f64>() < share);
            let d = decide(over, n);
            if d != Decision::Undecided {
                return (d, n);
            }
        }
        (Decision::Undecided, budget)
    }

    /// Each rule's share of levels called breached, called held, and its
    /// mean requests, over `trials` levels at a true `share`.
    fn rates(
        share: f64,
        trials: u32,
        budget: u64,
        seed: u64,
        decide: &dyn Fn(u64, u64) -> Decision,
    ) -> (f64, f64, f64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (mut breached, mut held, mut requests) = (0, 0, 0);
        for _ in 0..trials {
            let (d, n) = simulate(&mut rng, share, budget, decide);
            breached += u32::from(d == Decision::Breached);
            held += u32::from(d == Decision::Holds);
            requests += n;
        }
        let t = f64::from(trials);
        (
            f64::from(breached) / t,
            f64::from(held) / t,
            requests as f64 / t,
        )
    }

    /// Both rules on simulated levels of a `percentile` at 90%, each with
    /// the budget a sweep gives it (four times the fewest requests that
    /// can hold), checked after every request as the sweep checks: per
    /// true share, (share, old breached, old held, old mean requests, new
    /// breached, new held, new mean requests). Printed as the table in
    /// docs/sweep.md.
    fn compare_rules(percentile: f64, shares: &[f64], trials: u32) -> Vec<[f64; 7]> {
        let c = 0.9;
        let sprt = DecisionRule::default().test(percentile, c);
        let old = |over, n| percentile_holds(over, n, percentile, c);
        let new = |over, n| sprt.decide(over, n);
        let (old_budget, new_budget) = (4 * min_requests(percentile, c), 4 * sprt.min_requests());
        eprintln!("p{:.0}: | true share over | exceedance bound: breached, held, mean requests | sequential test: the same |", percentile * 100.0);
        shares
            .iter()
            .enumerate()
            .map(|(i, &share)| {
                let seed = 7 + i as u64;
                let (ob, oh, on) = rates(share, trials, old_budget, seed, &old);
                let (nb, nh, nn) = rates(share, trials, new_budget, seed, &new);
                eprintln!(
                    "| {:.1}% | {:.1}%, {:.1}%, {on:.0} | {:.1}%, {:.1}%, {nn:.0} |",
                    share * 100.0,
                    ob * 100.0,
                    oh * 100.0,
                    nb * 100.0,
                    nh * 100.0
                );
                [share, ob, oh, on, nb, nh, nn]
            })
            .collect()
    }

    #[test]
    fn the_sequential_test_keeps_its_errors_where_the_exceedance_bound_does_not() {
        let zone = DecisionRule::default().p95;
        let rows = compare_rules(
            0.95,
            &[0.0, 0.02, 0.04, 0.05, 0.06, 0.075, 0.09, 0.10, 0.12, 0.15],
            2000,
        );
        for [share, ob, oh, on, nb, nh, nn] in rows {
            // Up to p0 a breach is the error; from p1 on, a hold is.
            if share <= zone.p0 {
                assert!(nb <= 0.1, "{share}: breached {nb}");
                // And the levels that hold are decided sooner, and more of
                // them held.
                if share > 0.0 {
                    assert!(nn < on && nh > oh, "{share}: {nn} vs {on}, {nh} vs {oh}");
                }
            }
            if share >= zone.p1 {
                assert!(nh <= 0.1, "{share}: held {nh}");
            }
            // The exceedance bound, checked after every request, calls a
            // level with 4% over its p95 limit breached far more often than
            // its 10%: each look is another chance at an early lower bound
            // past 5%.
            if share == 0.04 {
                assert!(ob > 0.15, "{share}: {ob}");
            }
        }
    }

    #[test]
    fn the_p99_zone_keeps_its_errors_too() {
        let zone = DecisionRule::default().p99;
        for [share, _, _, _, nb, nh, _] in compare_rules(0.99, &[0.0, 0.01, 0.02, 0.03, 0.05], 400)
        {
            if share <= zone.p0 {
                assert!(nb <= 0.1, "{share}: breached {nb}");
            }
            if share >= zone.p1 {
                assert!(nh <= 0.1, "{share}: held {nh}");
            }
        }
    }

    #[test]
    fn the_sequential_test_decides_at_worked_numbers() {
        let t = DecisionRule::default().test(0.95, 0.9);
        // ln 9 / -ln(0.90 / 0.95) = 40.6: 41 fast requests hold a p95.
        assert_eq!(t.min_requests(), 41);
        assert_eq!(t.decide(0, 41), Decision::Holds);
        assert_eq!(t.decide(0, 40), Decision::Undecided);
        // Each request over costs ln 2 / 0.054 = 12.8 more fast ones: one
        // over in 41 needs 14 more.
        assert_eq!(t.requests_to_hold(1, 41), 14);
        assert_eq!(t.decide(1, 54), Decision::Undecided);
        assert_eq!(t.decide(1, 55), Decision::Holds);
        // 4 of 4 over: 4 ln 2 = 2.77 >= ln 9, breached; 3 of 3 is not.
        assert_eq!(t.decide(4, 4), Decision::Breached);
        assert_eq!(t.decide(3, 3), Decision::Undecided);
        // The p95's allowance, 5 of 100, is not yet held (the exceedance
        // bound never holds it); 5 of 110 is. 10 of 100 is not yet a
        // breach, 11 of 100 is.
        assert_eq!(t.decide(5, 100), Decision::Undecided);
        assert_eq!(t.decide(5, 110), Decision::Holds);
        assert_eq!(t.decide(10, 100), Decision::Undecided);
        assert_eq!(t.decide(11, 100), Decision::Breached);
        // A p99: 108 fast requests.
        assert_eq!(DecisionRule::default().test(0.99, 0.9).min_requests(), 108);
        // A zone that is not one is refused, naming the field.
        let bad = DecisionRule {
            p95: ShareZone { p0: 0.1, p1: 0.05 },
            ..DecisionRule::default()
        };
        assert!(bad.check().unwrap_err().contains("slo.decision.p95"));
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
