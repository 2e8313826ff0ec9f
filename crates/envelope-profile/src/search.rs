//! The search for the largest concurrency that meets every SLO: an
//! exponential probe up to the first breach, then bisection between the
//! largest feasible and the smallest infeasible level (AIPerf's
//! max-concurrency-under-SLA search). Plain state, no I/O.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bracket {
    pub min: u32,
    pub max: u32,
    /// Largest level that met every SLO.
    pub feasible: Option<u32>,
    /// Smallest level that breached one.
    pub infeasible: Option<u32>,
    pub probes: u32,
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Probe(u32),
    Done,
}

impl Bracket {
    pub fn new(min: u32, max: u32) -> Bracket {
        let min = min.max(1);
        Bracket {
            min,
            max: max.max(min),
            feasible: None,
            infeasible: None,
            probes: 0,
        }
    }

    pub fn next(&self) -> Step {
        match (self.feasible, self.infeasible) {
            (None, None) => Step::Probe(self.min),
            (None, Some(_)) => Step::Done, // even the minimum breaches
            (Some(f), None) if f >= self.max => Step::Done,
            (Some(f), None) => Step::Probe((f.saturating_mul(2)).min(self.max)),
            (Some(f), Some(i)) if i <= f + 1 => Step::Done,
            (Some(f), Some(i)) => Step::Probe(f + (i - f) / 2),
        }
    }

    /// Records a probe at `level`: `ok` when every SLO held.
    pub fn record(&mut self, level: u32, ok: bool) {
        self.probes += 1;
        if ok {
            self.feasible = Some(self.feasible.map_or(level, |f| f.max(level)));
        } else {
            self.infeasible = Some(self.infeasible.map_or(level, |i| i.min(level)));
        }
        // A noisy probe can contradict an earlier one; the smaller infeasible wins.
        if let (Some(f), Some(i)) = (self.feasible, self.infeasible) {
            if f >= i {
                self.feasible = if i > self.min { Some(i - 1) } else { None };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(true_max: u32, min: u32, max: u32) -> Bracket {
        let mut b = Bracket::new(min, max);
        while let Step::Probe(c) = b.next() {
            b.record(c, c <= true_max);
            assert!(b.probes < 64, "does not terminate");
        }
        b
    }

    #[test]
    fn finds_the_exact_maximum() {
        for true_max in 1..=100 {
            let b = run(true_max, 1, 256);
            assert_eq!(b.feasible, Some(true_max), "true max {true_max}");
            assert_eq!(b.infeasible, Some(true_max + 1));
            // Exponential plus bisection: about 2 log2(n) probes.
            assert!(
                b.probes <= 2 * (32 - true_max.leading_zeros()) + 2,
                "{true_max}: {} probes",
                b.probes
            );
        }
    }

    #[test]
    fn respects_the_cap_and_the_minimum() {
        let b = run(1000, 1, 64);
        assert_eq!(b.feasible, Some(64));
        assert_eq!(b.infeasible, None);
        let b = run(0, 1, 64);
        assert_eq!(b.feasible, None);
        assert_eq!(b.infeasible, Some(1));
        let b = run(10, 4, 64);
        assert_eq!(b.feasible, Some(10));
    }

    #[test]
    fn contradictions_resolve_to_the_smaller_infeasible() {
        let mut b = Bracket::new(1, 64);
        b.record(8, false);
        b.record(16, true); // noise
        assert_eq!(b.infeasible, Some(8));
        assert_eq!(b.feasible, Some(7));
    }
}
