//! How long a request would wait before it fits, and the Retry-After a
//! refusal states: from the ledger's free room, what is queued ahead of it
//! and how fast reservations drain. Plain functions over the state, with
//! worked numbers in the tests.

use crate::drain::{retry_after_from_ms, DrainEstimator};
use crate::ledger::{Demand, Ledger};

/// Estimated wait before `ahead` (what is queued ahead of a request, and
/// the request) fits, in ms: the larger of the KV tokens that must drain
/// (at the measured rate) and the sequences and capacity units that must
/// finish (a full node finishes its whole cap per mean service time).
/// `None` before anything was measured.
pub(crate) fn wait_ms(
    ledger: &Ledger,
    ahead: Demand,
    drain: &mut DrainEstimator,
    now_ms: u64,
) -> Option<f64> {
    let cap = ledger.capacity();
    let used = ledger.used();
    let kv_excess = ahead.kv_tokens.saturating_sub(ledger.kv_headroom());
    let seq_excess = ahead
        .seqs
        .saturating_sub(cap.seqs.saturating_sub(used.seqs));
    let unit_excess = ahead
        .capacity
        .saturating_sub(cap.capacity.saturating_sub(used.capacity));
    let kv_wait = drain.wait_ms(now_ms, kv_excess, cap.kv_tokens);
    let per_service = |excess: u64, cap: u64| {
        if excess == 0 {
            Some(0.0)
        } else {
            drain
                .service_ms()
                .map(|s| s * excess as f64 / cap.max(1) as f64)
        }
    };
    let seq_wait = max_known(
        per_service(seq_excess, cap.seqs),
        per_service(unit_excess, cap.capacity),
    );
    max_known(kv_wait, seq_wait)
}

/// Whole seconds (1..=60) until `ahead` would likely fit: the estimated
/// wait, else one mean service time, else a second.
pub(crate) fn retry_after_s(
    ledger: &Ledger,
    ahead: Demand,
    drain: &mut DrainEstimator,
    now_ms: u64,
) -> u64 {
    let w = wait_ms(ledger, ahead, drain, now_ms)
        .filter(|&w| w > 0.0)
        .or(drain.service_ms())
        .unwrap_or(1000.0);
    retry_after_from_ms(w)
}

fn max_known(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn d(seqs: u64, kv_tokens: u64, capacity: u64) -> Demand {
        Demand {
            seqs,
            kv_tokens,
            capacity,
        }
    }

    /// A node of 4 sequences, 1,000 KV tokens and 4 capacity units, full:
    /// four requests of (1, 250, 1) in flight.
    fn full_node() -> Ledger {
        let mut l = Ledger::new(d(4, 1000, 4), &HashMap::new(), 1.0);
        for _ in 0..4 {
            l.reserve("t", d(1, 250, 1)).unwrap();
        }
        l
    }

    /// One release of 250 tokens at 0 ms after a 2,000 ms service.
    fn one_release() -> DrainEstimator {
        let mut drain = DrainEstimator::new(10_000);
        drain.record(0, 250, 2000);
        drain
    }

    #[test]
    fn kv_that_must_drain_binds_the_wait() {
        // 500 KV tokens ahead on a full node: the measured 250 tokens a
        // second, or a full node's 1,000 per 2,000 ms service (500 a
        // second), whichever is faster: 1,000 ms. Its one sequence waits
        // a quarter of a service (500 ms): the KV binds.
        let mut drain = one_release();
        let w = wait_ms(&full_node(), d(1, 500, 1), &mut drain, 1000);
        assert_eq!(w, Some(1000.0));
        assert_eq!(
            retry_after_s(&full_node(), d(1, 500, 1), &mut drain, 1000),
            1
        );
    }

    #[test]
    fn sequences_that_must_finish_bind_the_wait() {
        // Three requests of 10 tokens ahead: 30 tokens drain in 60 ms,
        // but three of the four sequences must finish first: 3/4 of a
        // 2,000 ms service.
        let mut drain = one_release();
        let w = wait_ms(&full_node(), d(3, 30, 3), &mut drain, 1000);
        assert_eq!(w, Some(1500.0));
        assert_eq!(
            retry_after_s(&full_node(), d(3, 30, 3), &mut drain, 1000),
            2
        );
    }

    #[test]
    fn room_now_is_no_wait_and_nothing_measured_is_unknown() {
        let mut drain = one_release();
        let empty = Ledger::new(d(4, 1000, 4), &HashMap::new(), 1.0);
        assert_eq!(wait_ms(&empty, d(1, 250, 1), &mut drain, 1000), Some(0.0));
        // No wait estimate: Retry-After is one mean service time.
        assert_eq!(retry_after_s(&empty, d(1, 250, 1), &mut drain, 1000), 2);
        let mut fresh = DrainEstimator::new(10_000);
        assert_eq!(wait_ms(&full_node(), d(1, 250, 1), &mut fresh, 1000), None);
        // Nothing measured at all: a second.
        assert_eq!(
            retry_after_s(&full_node(), d(1, 250, 1), &mut fresh, 1000),
            1
        );
    }
}
