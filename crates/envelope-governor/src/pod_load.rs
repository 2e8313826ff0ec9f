//! What one governed pod holds and can still take, as an endpoint picker
//! (llm-d's, the Gateway API Inference Extension's) reads it: a queue, the
//! requests running, and how full the pod is against its *own* measured
//! envelope, so that 1.0 means this pod's limit whatever its size.
//!
//! A picker compares raw gauges with one pool-wide threshold (a queue of
//! 5, KV use 0.8). An engine's KV use says how full its cache is, not how
//! much more it can take inside its SLOs; the governor knows the latter
//! from the profile. [`PodLoad`] is a snapshot of the admission state and
//! the engine's waiting count; its methods are the gauges.

/// One reading of the pod. Capacities are the ones in force now (the live
/// guards may have lowered them below the profile's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PodLoad {
    /// Requests waiting in the governor's admission queue.
    pub governor_queued: u64,
    /// Requests the engine reports waiting (admitted by the governor, not
    /// yet scheduled by the engine); `None` without an engine reading.
    pub engine_waiting: Option<u64>,
    /// Requests the governor has sent upstream and not finished.
    pub in_flight: u64,
    /// Capacity units of the envelope held, and the limit admitted now.
    pub envelope_used: u64,
    pub envelope_limit: u64,
    /// Units one sequence of the cheapest bucket costs: with less free
    /// than this, no request of any measured shape is admitted.
    pub cheapest_sequence: u64,
    pub kv_reserved: u64,
    pub kv_limit: u64,
    /// KV tokens of one sequence of the smallest bucket (its prompt and
    /// output): with less free than this, no request of that whole shape
    /// fits.
    pub smallest_sequence_kv: u64,
    pub sequences: u64,
    pub sequence_limit: u64,
    /// The governor refuses every new request (draining, or the live
    /// guard's `reject_new`).
    pub refusing_new: bool,
}

impl PodLoad {
    /// The engine's waiting requests that are this governor's: no more
    /// than it has in flight (a reading from a moment ago may say more).
    fn engine_waiting_in_flight(&self) -> u64 {
        self.engine_waiting.unwrap_or(0).min(self.in_flight)
    }

    /// Everything waiting at this pod: the governor's queue and the
    /// engine's own.
    pub fn queued_requests(&self) -> u64 {
        self.governor_queued + self.engine_waiting_in_flight()
    }

    /// Requests the engine is running: in flight less those it reports
    /// waiting, so that queued + running is the governor's queue plus its
    /// requests in flight, each request once.
    pub fn running_requests(&self) -> u64 {
        self.in_flight - self.engine_waiting_in_flight()
    }

    /// KV tokens reserved over the KV budget in force, 0..1.
    pub fn kv_reserved_ratio(&self) -> f64 {
        ratio(self.kv_reserved, self.kv_limit)
    }

    /// How full the pod is against its measured limit, 0..1: the fullest
    /// of its envelope, KV budget and sequence cap. 1.0 exactly when the
    /// governor queues (something waits in its queue), refuses everything
    /// new, or would not admit a request of the profile's cheapest measured
    /// shape (too little of the envelope or the KV budget left for one
    /// sequence of it, or the sequence cap reached). A request larger than
    /// that shape may wait below 1.0; once one does, it reads 1.0.
    pub fn saturation(&self) -> f64 {
        let envelope_full =
            self.envelope_limit.saturating_sub(self.envelope_used) < self.cheapest_sequence.max(1);
        let sequences_full = self.sequences >= self.sequence_limit;
        let kv_full =
            self.kv_limit.saturating_sub(self.kv_reserved) < self.smallest_sequence_kv.max(1);
        if self.refusing_new
            || self.governor_queued > 0
            || envelope_full
            || sequences_full
            || kv_full
        {
            return 1.0;
        }
        // Against what the envelope can hold of the cheapest shape: its
        // charge runs on the bucket's unrounded concurrency (4.5 admits 4,
        // which hold 0.89 of the envelope), so k of 4 reads k/4.
        let cheapest = self.cheapest_sequence.max(1);
        ratio(
            self.envelope_used,
            self.envelope_limit / cheapest * cheapest,
        )
        .max(self.kv_reserved_ratio())
        .max(ratio(self.sequences, self.sequence_limit))
    }

    /// The share of the pod's measured capacity still free to admit, 0..1
    /// (`1 - saturation`).
    pub fn admission_headroom(&self) -> f64 {
        1.0 - self.saturation()
    }
}

/// `used / limit` clamped to 0..1; a zero limit is full.
fn ratio(used: u64, limit: u64) -> f64 {
    if limit == 0 {
        return 1.0;
    }
    (used as f64 / limit as f64).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNITS: u64 = 1 << 30;

    /// An idle pod whose envelope admits `c` sequences of one shape.
    fn idle(c: u64) -> PodLoad {
        PodLoad {
            envelope_limit: UNITS,
            cheapest_sequence: UNITS / c,
            kv_limit: 10_000,
            smallest_sequence_kv: 100,
            sequence_limit: 64,
            ..PodLoad::default()
        }
    }

    fn holding(c: u64, n: u64) -> PodLoad {
        PodLoad {
            in_flight: n,
            sequences: n,
            envelope_used: n * (UNITS / c),
            kv_reserved: n * 100,
            ..idle(c)
        }
    }

    #[test]
    fn saturation_reaches_one_exactly_at_the_last_sequence_that_fits() {
        // Three of a shape safe at 3 hold 3 * floor(2^30 / 3) units, one
        // short of the whole: still full, as admission sees it.
        for c in [1, 3, 7, 8] {
            for n in 0..c {
                let s = holding(c, n).saturation();
                assert!(s < 1.0, "{n} of {c}: {s}");
                assert!((s - n as f64 / c as f64).abs() < 1e-6, "{n} of {c}: {s}");
            }
            assert_eq!(holding(c, c).saturation(), 1.0, "{c}");
            assert_eq!(holding(c, c).admission_headroom(), 0.0);
        }
        // A bucket whose concurrency after the headroom is 4.5: each of
        // its sequences is 1/4.5 of the envelope, 4 fit, and k of them
        // read k/4.
        let unrounded = |n: u64| PodLoad {
            cheapest_sequence: (UNITS as f64 / 4.5) as u64,
            envelope_used: n * (UNITS as f64 / 4.5) as u64,
            ..holding(4, n)
        };
        for n in 0..4 {
            let s = unrounded(n).saturation();
            assert!((s - n as f64 / 4.0).abs() < 1e-6, "{n}: {s}");
        }
        assert_eq!(unrounded(4).saturation(), 1.0);
    }

    #[test]
    fn a_smaller_pod_reads_fuller_at_the_same_load() {
        let (small, large) = (holding(4, 2), holding(8, 2));
        assert!(small.saturation() > large.saturation());
        assert!(small.admission_headroom() < large.admission_headroom());
    }

    #[test]
    fn any_full_resource_or_a_queue_or_refusing_saturates() {
        let base = holding(8, 2);
        let kv = PodLoad {
            kv_reserved: 10_000,
            ..base
        };
        assert_eq!(kv.kv_reserved_ratio(), 1.0);
        assert_eq!(kv.saturation(), 1.0);
        // Less KV free than one sequence of the smallest bucket: no whole
        // request of it fits, though the ratio is short of 1.
        let kv_short = PodLoad {
            kv_reserved: 9_901,
            ..base
        };
        assert!(kv_short.kv_reserved_ratio() < 1.0);
        assert_eq!(kv_short.saturation(), 1.0);
        let kv_room = PodLoad {
            kv_reserved: 9_900,
            ..base
        };
        assert!(kv_room.saturation() < 1.0);
        let seqs = PodLoad {
            sequence_limit: 2,
            ..base
        };
        assert_eq!(seqs.saturation(), 1.0);
        let queued = PodLoad {
            governor_queued: 1,
            ..base
        };
        assert_eq!(queued.saturation(), 1.0);
        let refusing = PodLoad {
            refusing_new: true,
            ..base
        };
        assert_eq!(refusing.saturation(), 1.0);
        // The latency guard lowered the limit to half: 2 of 8 is half of it.
        let lowered = PodLoad {
            envelope_limit: UNITS / 2,
            ..base
        };
        assert!((lowered.saturation() - 0.5).abs() < 1e-6);
        assert_eq!(
            PodLoad {
                envelope_limit: 0,
                ..base
            }
            .saturation(),
            1.0
        );
    }

    #[test]
    fn the_engines_waiting_requests_move_from_running_to_queued() {
        let p = PodLoad {
            governor_queued: 2,
            engine_waiting: Some(3),
            ..holding(8, 5)
        };
        assert_eq!(p.queued_requests(), 5);
        assert_eq!(p.running_requests(), 2);
        // A stale engine count above what is in flight counts only those:
        // queued + running is still the queue plus the requests in flight.
        let stale = PodLoad {
            governor_queued: 1,
            engine_waiting: Some(9),
            ..holding(8, 5)
        };
        assert_eq!(stale.running_requests(), 0);
        assert_eq!(stale.queued_requests(), 6);
        assert_eq!(holding(8, 5).running_requests(), 5);
        assert_eq!(holding(8, 5).queued_requests(), 0);
    }
}
