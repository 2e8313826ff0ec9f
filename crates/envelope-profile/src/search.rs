//! The search for the largest concurrency (or rate, or workload scale)
//! that meets every SLO: [`LevelSearch`] screens levels exponentially up to
//! the first breach, then by bisection between the largest feasible and the
//! smallest infeasible level (AIPerf's max-concurrency-under-SLA search),
//! and decides the two ends at a confidence. Plain state, no I/O.

/// What the probes of a level showed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LevelVerdict {
    /// Every SLO held at the confidence asked.
    Holds,
    /// An SLO was breached at the confidence asked, or a limit that is not
    /// a percentile (the KV cache, errors, a crash) was crossed.
    Breached,
    /// Decided to its request budget and still undecided: never passed.
    Undecided,
    /// A screening probe whose figures met every SLO, not yet decided.
    LooksOk,
    /// A screening probe whose figures breached an SLO, not yet decided.
    LooksBad,
}

impl LevelVerdict {
    /// Whether the search takes the level as feasible for now.
    pub fn ok(self) -> bool {
        matches!(self, LevelVerdict::Holds | LevelVerdict::LooksOk)
    }
}

/// What the level search wants next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LevelStep {
    /// A screening probe at a level not probed yet: its usual request
    /// count, stopped early once decided.
    Screen(u32),
    /// Extend the probe of this level until it is decided or its request
    /// budget is spent.
    Decide(u32),
    Done,
}

/// The bracket search with a confidence on its ends. Levels are screened
/// with short probes, exponentially up to the first breach and then by
/// bisection; once the bracket closes, its two ends
/// are decided at the confidence asked: the feasible level must hold (if it
/// does not, the search goes on below it) and the infeasible level's breach
/// is confirmed (if it holds after all, the search goes on above it).
/// Only levels next to the answer pay for a decided verdict; a level the
/// search passes is one that held at that confidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelSearch {
    pub min: u32,
    pub max: u32,
    levels: std::collections::BTreeMap<u32, LevelVerdict>,
}

impl LevelSearch {
    pub fn new(min: u32, max: u32) -> LevelSearch {
        let min = min.max(1);
        LevelSearch {
            min,
            max: max.max(min),
            levels: Default::default(),
        }
    }

    /// The lowest level not taken as feasible (a noisy probe can contradict
    /// an earlier one; the smaller infeasible wins).
    pub fn infeasible(&self) -> Option<u32> {
        self.levels.iter().find(|(_, v)| !v.ok()).map(|(l, _)| *l)
    }

    /// The highest feasible level below [`LevelSearch::infeasible`].
    pub fn feasible(&self) -> Option<u32> {
        let cap = self.infeasible().unwrap_or(u32::MAX);
        self.levels
            .range(..cap)
            .rev()
            .find(|(_, v)| v.ok())
            .map(|(l, _)| *l)
    }

    pub fn verdict(&self, level: u32) -> Option<LevelVerdict> {
        self.levels.get(&level).copied()
    }

    pub fn next(&self) -> LevelStep {
        let (f, i) = (self.feasible(), self.infeasible());
        let screen = match (f, i) {
            (None, None) => Some(self.min),
            (f, Some(i)) => {
                // Below the minimum counts as feasible: nothing to probe there.
                let lo = f.unwrap_or(self.min - 1);
                (i > lo + 1).then(|| lo + (i - lo) / 2)
            }
            (Some(f), None) => (f < self.max).then(|| f.saturating_mul(2).min(self.max)),
        };
        if let Some(k) = screen {
            return LevelStep::Screen(k);
        }
        if let Some(f) = f.filter(|f| self.levels[f] == LevelVerdict::LooksOk) {
            return LevelStep::Decide(f);
        }
        if let Some(i) = i.filter(|i| self.levels[i] == LevelVerdict::LooksBad) {
            return LevelStep::Decide(i);
        }
        // An undecided infeasible level: the interval's upper end is the
        // first breach decided above it.
        if let Some(i) = i.filter(|i| self.levels[i] == LevelVerdict::Undecided) {
            for (l, v) in self.levels.range(i + 1..) {
                match v {
                    LevelVerdict::Breached => break,
                    LevelVerdict::LooksBad => return LevelStep::Decide(*l),
                    _ => {}
                }
            }
        }
        LevelStep::Done
    }

    /// Records what a level's probe showed (a later verdict for the same
    /// level replaces the earlier).
    pub fn record(&mut self, level: u32, verdict: LevelVerdict) {
        self.levels.insert(level, verdict);
    }

    /// One below the lowest level whose breach was decided: the highest the
    /// feasible maximum can be at the confidence asked. `None` when no
    /// level was decided breached.
    pub fn upper(&self) -> Option<u32> {
        self.levels
            .iter()
            .find(|(_, v)| **v == LevelVerdict::Breached)
            .map(|(l, _)| l - 1)
    }
}

/// The probes a search from `min` to `max` runs when every screen reads
/// its level right, averaged over true maxima from below `min` to `max`
/// taken as equally likely (at most 64 of them, evenly spaced): its
/// screens and its decided ends. What a progress bar can expect; noisy
/// screens add to it.
pub fn expected_probes(min: u32, max: u32) -> f64 {
    let search = LevelSearch::new(min, max);
    let (lo, hi) = (search.min - 1, search.max);
    let span = hi - lo;
    let samples = span.min(63) + 1;
    let total: u64 = (0..samples)
        .map(|i| lo + (u64::from(i) * u64::from(span) / u64::from(samples - 1).max(1)) as u32)
        .map(|true_max| probes_against(search.clone(), true_max))
        .sum();
    total as f64 / f64::from(samples)
}

/// How many probes `search` runs against a server whose largest feasible
/// level is `true_max`, every screen right.
fn probes_against(mut search: LevelSearch, true_max: u32) -> u64 {
    let mut probes = 0;
    loop {
        let (level, verdict) = match search.next() {
            LevelStep::Screen(k) if k <= true_max => (k, LevelVerdict::LooksOk),
            LevelStep::Screen(k) => (k, LevelVerdict::LooksBad),
            LevelStep::Decide(k) if k <= true_max => (k, LevelVerdict::Holds),
            LevelStep::Decide(k) => (k, LevelVerdict::Breached),
            LevelStep::Done => return probes,
        };
        search.record(level, verdict);
        probes += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a level search against a true maximum; `screen_wrong` levels
    /// screen the wrong way (noise) and `undecided` ones never decide.
    fn run_levels(
        true_max: u32,
        max: u32,
        screen_wrong: &[u32],
        undecided: &[u32],
    ) -> (LevelSearch, Vec<LevelStep>) {
        run_from(1, true_max, max, screen_wrong, undecided)
    }

    fn run_from(
        min: u32,
        true_max: u32,
        max: u32,
        screen_wrong: &[u32],
        undecided: &[u32],
    ) -> (LevelSearch, Vec<LevelStep>) {
        let mut s = LevelSearch::new(min, max);
        let mut steps = vec![];
        loop {
            let step = s.next();
            steps.push(step);
            assert!(steps.len() < 64, "does not terminate: {steps:?}");
            match step {
                LevelStep::Screen(k) => {
                    let ok = (k <= true_max) != screen_wrong.contains(&k);
                    s.record(
                        k,
                        if ok {
                            LevelVerdict::LooksOk
                        } else {
                            LevelVerdict::LooksBad
                        },
                    );
                }
                LevelStep::Decide(k) => {
                    let v = if undecided.contains(&k) {
                        LevelVerdict::Undecided
                    } else if k <= true_max {
                        LevelVerdict::Holds
                    } else {
                        LevelVerdict::Breached
                    };
                    s.record(k, v);
                }
                LevelStep::Done => return (s, steps),
            }
        }
    }

    #[test]
    fn a_level_search_decides_only_the_two_ends() {
        for true_max in 1..=40 {
            let (s, steps) = run_levels(true_max, 64, &[], &[]);
            assert_eq!(s.feasible(), Some(true_max), "true max {true_max}");
            assert_eq!(s.verdict(true_max), Some(LevelVerdict::Holds));
            assert_eq!(s.upper(), Some(true_max), "{steps:?}");
            let decided: Vec<_> = steps
                .iter()
                .filter(|s| matches!(s, LevelStep::Decide(_)))
                .collect();
            assert_eq!(
                decided,
                vec![
                    &LevelStep::Decide(true_max),
                    &LevelStep::Decide(true_max + 1)
                ]
            );
        }
        // The cap: nothing above to decide, and no upper end.
        let (s, _) = run_levels(100, 16, &[], &[]);
        assert_eq!((s.feasible(), s.upper()), (Some(16), None));
        // Even the minimum breaches.
        let (s, steps) = run_levels(0, 16, &[], &[]);
        assert_eq!((s.feasible(), s.upper()), (None, Some(0)));
        assert_eq!(
            steps,
            vec![LevelStep::Screen(1), LevelStep::Decide(1), LevelStep::Done]
        );
    }

    #[test]
    fn the_expected_probes_are_the_search_s_own() {
        // One level: screened, then decided, whatever the server does.
        assert_eq!(expected_probes(1, 1), 2.0);
        assert_eq!(expected_probes(4, 4), 2.0);
        // Levels 1 and 2: a server that breaches at 1 takes 2 probes
        // (screen 1, decide 1); one whose most is 1 takes 4 (screen 1 and
        // 2, decide both); one that holds at 2 takes 3 (screens 1 and 2,
        // decide 2, the cap).
        assert_eq!(expected_probes(1, 2), 3.0);
        // Screens grow as log2 of the range, decisions stay at two.
        for max in [8, 16, 64, 256, 4096] {
            let e = expected_probes(1, max);
            let log2 = f64::from(32 - max.leading_zeros());
            assert!(e >= log2 && e <= 2.0 * log2 + 2.0, "{max}: {e}");
        }
        assert!(expected_probes(1, 64) > expected_probes(1, 8));
    }

    #[test]
    fn screens_about_two_log2_levels() {
        for true_max in 1..=100 {
            let (s, steps) = run_levels(true_max, 256, &[], &[]);
            assert_eq!(s.feasible(), Some(true_max), "true max {true_max}");
            let screens = steps
                .iter()
                .filter(|s| matches!(s, LevelStep::Screen(_)))
                .count() as u32;
            // Exponential plus bisection: about 2 log2(n) screens.
            assert!(
                screens <= 2 * (32 - true_max.leading_zeros()) + 2,
                "{true_max}: {screens} screens"
            );
        }
    }

    #[test]
    fn respects_the_minimum() {
        let (s, steps) = run_from(4, 10, 64, &[], &[]);
        assert_eq!((s.feasible(), s.upper()), (Some(10), Some(10)));
        assert_eq!(steps[0], LevelStep::Screen(4));
        assert!(steps.iter().all(|s| match s {
            LevelStep::Screen(k) | LevelStep::Decide(k) => *k >= 4,
            LevelStep::Done => true,
        }));
        // Even the minimum breaches: nothing below it is probed.
        let (s, steps) = run_from(4, 2, 64, &[], &[]);
        assert_eq!((s.feasible(), s.upper()), (None, Some(3)));
        assert_eq!(
            steps,
            vec![LevelStep::Screen(4), LevelStep::Decide(4), LevelStep::Done]
        );
    }

    #[test]
    fn contradicting_screens_resolve_to_the_smaller_infeasible() {
        let mut s = LevelSearch::new(1, 64);
        s.record(4, LevelVerdict::LooksOk);
        s.record(8, LevelVerdict::LooksBad);
        s.record(16, LevelVerdict::LooksOk); // noise
        assert_eq!((s.feasible(), s.infeasible()), (Some(4), Some(8)));
        assert_eq!(s.next(), LevelStep::Screen(6));
    }

    #[test]
    fn a_screen_that_lied_is_corrected_by_the_decision() {
        // 12 screens fine but breaches: the search goes on below it.
        let (s, _) = run_levels(10, 64, &[12], &[]);
        assert_eq!(s.feasible(), Some(10));
        assert_eq!(s.upper(), Some(10));
        // 11 screens bad but holds: the search goes on above it.
        let (s, _) = run_levels(11, 64, &[12, 11], &[]);
        assert_eq!(s.feasible(), Some(11));
    }

    #[test]
    fn an_undecided_level_is_never_passed_and_widens_the_interval() {
        // 13 holds in truth but cannot be decided: the answer is 12, and
        // the breach decided at 14 leaves the maximum within [12, 13].
        let (s, _) = run_levels(13, 64, &[], &[13]);
        assert_eq!(s.feasible(), Some(12));
        assert_eq!(s.verdict(13), Some(LevelVerdict::Undecided));
        assert_eq!(s.upper(), Some(13));
    }
}
