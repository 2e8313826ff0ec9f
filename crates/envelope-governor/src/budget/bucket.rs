//! The arithmetic of a budget: a bucket that holds up to `capacity` units
//! and refills at `capacity` per window, continuously (a token bucket, as
//! Envoy's and LiteLLM's rate limits are). A decision over several buckets
//! at once is all or nothing: the request takes its amount from every
//! enforced bucket, or from none and waits for the slowest to refill.
//!
//! The in-process store runs these functions; the Redis store runs the
//! same steps in a Lua script (`store.rs`), and both are tested against
//! the same cases.

/// A bucket's stored state: its level at `at_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct State {
    pub level: f64,
    pub at_ms: u64,
}

/// One bucket's part in a decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Withdrawal {
    pub capacity: f64,
    pub window_ms: u64,
    pub amount: f64,
    /// Shadow mode: never refuses; counts what it would have refused.
    pub shadow: bool,
}

/// A decision over several buckets.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub admitted: bool,
    /// Time until every refusing bucket holds its amount (0 if admitted).
    pub wait_ms: u64,
    /// The refusing bucket that waits longest.
    pub refusing: Option<usize>,
    /// Each bucket's level after the decision.
    pub levels: Vec<f64>,
    /// Shadow buckets that would have refused (they took nothing).
    pub would_refuse: Vec<bool>,
}

/// The level at `now_ms`: the stored level plus what refilled since,
/// at most the capacity; a bucket never seen is full.
pub fn level_at(s: Option<State>, capacity: f64, window_ms: u64, now_ms: u64) -> f64 {
    match s {
        None => capacity,
        Some(s) => {
            let refilled = now_ms.saturating_sub(s.at_ms) as f64 * capacity / window_ms as f64;
            (s.level + refilled).min(capacity)
        }
    }
}

/// Milliseconds until a bucket at `level` holds `amount`.
pub fn wait_ms(level: f64, amount: f64, capacity: f64, window_ms: u64) -> u64 {
    if level >= amount || capacity <= 0.0 {
        return 0;
    }
    ((amount - level) * window_ms as f64 / capacity).ceil() as u64
}

/// Milliseconds until a bucket at `level` is full again.
pub fn reset_ms(level: f64, capacity: f64, window_ms: u64) -> u64 {
    wait_ms(level, capacity, capacity, window_ms)
}

/// Decides `asks` against buckets at `levels` (already refilled to now).
pub fn decide(asks: &[Withdrawal], levels: &[f64]) -> Outcome {
    let mut wait = 0;
    let mut refusing = None;
    for (i, (a, &l)) in asks.iter().zip(levels).enumerate() {
        if !a.shadow && l < a.amount {
            let w = wait_ms(l, a.amount, a.capacity, a.window_ms).max(1);
            if w > wait {
                wait = w;
                refusing = Some(i);
            }
        }
    }
    let admitted = refusing.is_none();
    let mut out = levels.to_vec();
    let mut would_refuse = vec![false; asks.len()];
    if admitted {
        for (i, a) in asks.iter().enumerate() {
            if out[i] >= a.amount {
                out[i] -= a.amount;
            } else {
                would_refuse[i] = true;
            }
        }
    }
    Outcome {
        admitted,
        wait_ms: wait,
        refusing,
        levels: out,
        would_refuse,
    }
}

/// A settlement: `delta` back into a bucket at `level` (negative takes
/// more: usage over the reservation leaves the bucket in debt).
pub fn settle(level: f64, delta: f64, capacity: f64) -> f64 {
    (level + delta).min(capacity)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(capacity: f64, amount: f64) -> Withdrawal {
        Withdrawal {
            capacity,
            window_ms: 60_000,
            amount,
            shadow: false,
        }
    }

    #[test]
    fn a_bucket_refills_continuously_up_to_its_capacity() {
        let s = Some(State {
            level: 10.0,
            at_ms: 1_000,
        });
        assert_eq!(level_at(None, 600.0, 60_000, 5), 600.0);
        assert_eq!(level_at(s, 600.0, 60_000, 1_000), 10.0);
        // 600 per minute is 10 per second.
        assert_eq!(level_at(s, 600.0, 60_000, 2_000), 20.0);
        assert_eq!(level_at(s, 600.0, 60_000, 1_000_000), 600.0);
        // A clock that steps back refills nothing.
        assert_eq!(level_at(s, 600.0, 60_000, 0), 10.0);
    }

    #[test]
    fn all_or_nothing_and_the_slowest_bucket_sets_the_wait() {
        let asks = [ask(600.0, 100.0), ask(60.0, 1.0), ask(6000.0, 50.0)];
        let o = decide(&asks, &[100.0, 5.0, 6000.0]);
        assert!(o.admitted);
        assert_eq!(o.levels, vec![0.0, 4.0, 5950.0]);
        // The first bucket is short by 40 (4 s at 10/s), the second by 0.5
        // (0.5 s at 1/s): the request waits 4 s and takes nothing.
        let o = decide(&asks, &[60.0, 0.5, 6000.0]);
        assert!(!o.admitted);
        assert_eq!(o.refusing, Some(0));
        assert_eq!(o.wait_ms, 4_000);
        assert_eq!(o.levels, vec![60.0, 0.5, 6000.0]);
    }

    #[test]
    fn shadow_buckets_never_refuse_and_take_only_what_they_hold() {
        let mut asks = [ask(10.0, 4.0), ask(10.0, 4.0)];
        asks[1].shadow = true;
        let o = decide(&asks, &[10.0, 3.0]);
        assert!(o.admitted);
        assert_eq!(o.would_refuse, vec![false, true]);
        // What an enforcing bucket would have refused is not spent.
        assert_eq!(o.levels, vec![6.0, 3.0]);
        // An enforced refusal takes nothing from the shadow bucket either.
        let o = decide(&asks, &[3.0, 10.0]);
        assert!(!o.admitted);
        assert_eq!(o.levels, vec![3.0, 10.0]);
        assert_eq!(o.would_refuse, vec![false, false]);
    }

    #[test]
    fn settling_refunds_up_to_capacity_and_overuse_leaves_debt() {
        assert_eq!(settle(10.0, 30.0, 100.0), 40.0);
        assert_eq!(settle(90.0, 30.0, 100.0), 100.0);
        assert_eq!(settle(2.0, -5.0, 100.0), -3.0);
        // A bucket in debt refills to zero before it admits anything.
        assert_eq!(wait_ms(-3.0, 1.0, 60.0, 60_000), 4_000);
        assert_eq!(reset_ms(30.0, 60.0, 60_000), 30_000);
    }
}
