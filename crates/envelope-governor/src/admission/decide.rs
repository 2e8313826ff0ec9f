//! Admission's decision as a pure function: what admission knows at a
//! request's arrival ([`Snapshot`]) and what the request and the settings
//! allow it ([`Terms`]) give one [`Decision`]: admit now, queue for at most
//! so long, or refuse and why. [`Governor::admit`](super::Governor::admit)
//! takes the snapshot under its lock and acts on the decision; the rules
//! and their order live here alone, tested with worked numbers.

use crate::ledger::Refusal;

/// Admission's state at one request's arrival.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Snapshot {
    /// The governor is draining (shutting down or reloading away).
    pub draining: bool,
    /// The live guard refuses all new work (its ladder at REJECT_NEW).
    pub reject_new: bool,
    /// Whether the request fits the ledger now, and why not
    /// ([`crate::ledger::Ledger::check`]).
    pub fit: Result<(), Refusal>,
    /// Requests wait in the queue (a new one queues behind them, whatever
    /// fits).
    pub queued: bool,
    /// The estimated wait before it would fit, ms; `None` before anything
    /// was measured. Taken only for a request that cannot start now.
    pub wait_ms: Option<f64>,
    /// The mean service time measured, ms.
    pub service_ms: Option<f64>,
    /// The TTFT p95 the proxied streams show now, ms.
    pub recent_ttft_p95_ms: Option<f64>,
}

/// What the request and the settings allow it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Terms {
    /// Until its deadline, ms.
    pub left_ms: f64,
    /// The longest any request may wait in the queue, ms.
    pub max_queue_age_ms: f64,
    /// Its TTFT budget where over-budget requests are shed (its class's,
    /// or its own objective where tighter: [`ttft_budget_ms`]); `None` where
    /// none is set or the setting queues them anyway.
    pub ttft_budget_ms: Option<f64>,
    /// The profile's TTFT p95 for the costliest bucket it is charged as.
    pub expected_ttft_ms: Option<f64>,
}

/// What bounds a queued request's wait, and so what its timeout is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueBound {
    /// Its deadline.
    Deadline,
    /// The queue's age limit.
    QueueAge,
    /// Its TTFT budget, less the TTFT it is expected to take.
    TtftBudget,
}

/// Why a request is refused at arrival.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Shed {
    Draining,
    /// The live guard refuses new work.
    RejectNew,
    /// It cannot run even on an idle server at the profile's caps.
    NeverFits,
    /// It fits the profile's caps but not the caps the live guard lowered.
    Tightened,
    /// The wait and the service take longer than its deadline leaves.
    DeadlineUnmeetable {
        wait_ms: f64,
        service_ms: f64,
        left_ms: f64,
    },
    /// The wait and the expected TTFT take longer than its TTFT budget.
    TtftBudget {
        wait_ms: f64,
        ttft_ms: f64,
        budget_ms: f64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Decision {
    AdmitNow,
    /// Wait in the queue for at most `max_wait_ms` (a full queue still
    /// refuses it at the push).
    Queue {
        max_wait_ms: f64,
        bound: QueueBound,
    },
    Shed(Shed),
}

/// A request's TTFT budget: its class's, or its own objective where that is
/// tighter (a client asking for more time than its class gets none).
pub(crate) fn ttft_budget_ms(class_budget: Option<f64>, objective: Option<f64>) -> Option<f64> {
    match (class_budget, objective) {
        (Some(c), Some(o)) => Some(c.min(o)),
        (c, o) => c.or(o),
    }
}

/// The decision. Refusals in this order: draining, the guard refusing new
/// work, never fits, fits only the caps the guard lowered; then a request
/// that fits with nobody queued is admitted; then, on the measured wait,
/// one that could not finish by its deadline or start within its TTFT
/// budget is refused, and the rest queue until the nearest of the deadline,
/// the queue's age limit and the budget less the expected TTFT. Nothing
/// measured yet (no wait estimate) sheds nothing.
pub(crate) fn decide(s: &Snapshot, t: &Terms) -> Decision {
    if s.draining {
        return Decision::Shed(Shed::Draining);
    }
    if s.reject_new {
        return Decision::Shed(Shed::RejectNew);
    }
    match s.fit {
        Err(Refusal::NeverFits) => return Decision::Shed(Shed::NeverFits),
        Err(Refusal::Tightened) => return Decision::Shed(Shed::Tightened),
        Ok(()) if !s.queued => return Decision::AdmitNow,
        _ => {}
    }
    let service_ms = s.service_ms.unwrap_or(0.0);
    if let Some(wait_ms) = s.wait_ms {
        if wait_ms + service_ms > t.left_ms {
            return Decision::Shed(Shed::DeadlineUnmeetable {
                wait_ms,
                service_ms,
                left_ms: t.left_ms,
            });
        }
    }
    let (mut max_wait_ms, mut bound) = if t.left_ms <= t.max_queue_age_ms {
        (t.left_ms, QueueBound::Deadline)
    } else {
        (t.max_queue_age_ms, QueueBound::QueueAge)
    };
    if let Some(budget_ms) = t.ttft_budget_ms {
        // The bucket's TTFT as measured, or as the proxied streams show it
        // now when that is worse: the profile's latency is not trusted
        // past what the node does today.
        let ttft_ms = t
            .expected_ttft_ms
            .unwrap_or(0.0)
            .max(s.recent_ttft_p95_ms.unwrap_or(0.0));
        if let Some(wait_ms) = s.wait_ms {
            if wait_ms + ttft_ms > budget_ms {
                return Decision::Shed(Shed::TtftBudget {
                    wait_ms,
                    ttft_ms,
                    budget_ms,
                });
            }
        }
        let by_budget = (budget_ms - ttft_ms).max(0.0);
        if by_budget < max_wait_ms {
            (max_wait_ms, bound) = (by_budget, QueueBound::TtftBudget);
        }
    }
    Decision::Queue { max_wait_ms, bound }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Room now, nobody queued, nothing measured, no budget.
    fn idle() -> Snapshot {
        Snapshot {
            draining: false,
            reject_new: false,
            fit: Ok(()),
            queued: false,
            wait_ms: None,
            service_ms: None,
            recent_ttft_p95_ms: None,
        }
    }

    /// No room now: the request would wait `wait_ms`, served in
    /// `service_ms`.
    fn full(wait_ms: f64, service_ms: f64) -> Snapshot {
        Snapshot {
            fit: Err(Refusal::Global),
            wait_ms: Some(wait_ms),
            service_ms: Some(service_ms),
            ..idle()
        }
    }

    fn terms(left_ms: f64) -> Terms {
        Terms {
            left_ms,
            max_queue_age_ms: 30_000.0,
            ttft_budget_ms: None,
            expected_ttft_ms: None,
        }
    }

    #[test]
    fn admits_now_when_it_fits_and_none_wait() {
        assert_eq!(decide(&idle(), &terms(60_000.0)), Decision::AdmitNow);
        // Even with a deadline already past: it starts at once.
        assert_eq!(decide(&idle(), &terms(0.0)), Decision::AdmitNow);
    }

    #[test]
    fn a_request_that_fits_queues_behind_those_waiting() {
        let s = Snapshot {
            queued: true,
            wait_ms: Some(200.0),
            ..idle()
        };
        assert_eq!(
            decide(&s, &terms(60_000.0)),
            Decision::Queue {
                max_wait_ms: 30_000.0,
                bound: QueueBound::QueueAge
            }
        );
    }

    #[test]
    fn deadline_unmeetable() {
        // 800 ms of wait and 400 of service do not fit in 1,000 ms left.
        assert_eq!(
            decide(&full(800.0, 400.0), &terms(1000.0)),
            Decision::Shed(Shed::DeadlineUnmeetable {
                wait_ms: 800.0,
                service_ms: 400.0,
                left_ms: 1000.0
            })
        );
        // They fit in 1,300: it queues until its deadline.
        assert_eq!(
            decide(&full(800.0, 400.0), &terms(1300.0)),
            Decision::Queue {
                max_wait_ms: 1300.0,
                bound: QueueBound::Deadline
            }
        );
    }

    #[test]
    fn ttft_budget_sheds() {
        // Budget 1,000 ms; the profile expects a TTFT of 300 ms, the
        // streams show 500 now: 500 counts.
        let budget = Terms {
            ttft_budget_ms: Some(1000.0),
            expected_ttft_ms: Some(300.0),
            ..terms(60_000.0)
        };
        let observed = |wait_ms| Snapshot {
            recent_ttft_p95_ms: Some(500.0),
            ..full(wait_ms, 100.0)
        };
        // 600 ms of wait + 500 > 1,000.
        assert_eq!(
            decide(&observed(600.0), &budget),
            Decision::Shed(Shed::TtftBudget {
                wait_ms: 600.0,
                ttft_ms: 500.0,
                budget_ms: 1000.0
            })
        );
        // 400 + 500 fits: it may wait what the budget leaves, 500 ms.
        assert_eq!(
            decide(&observed(400.0), &budget),
            Decision::Queue {
                max_wait_ms: 500.0,
                bound: QueueBound::TtftBudget
            }
        );
        // With the streams quiet the profile's 300 ms counts: 600 + 300
        // fits, and it may wait 700.
        let quiet = Snapshot {
            recent_ttft_p95_ms: None,
            ..observed(600.0)
        };
        assert_eq!(
            decide(&quiet, &budget),
            Decision::Queue {
                max_wait_ms: 700.0,
                bound: QueueBound::TtftBudget
            }
        );
    }

    #[test]
    fn an_objective_tighter_than_the_class_is_the_budget() {
        assert_eq!(ttft_budget_ms(Some(2000.0), Some(800.0)), Some(800.0));
        assert_eq!(ttft_budget_ms(Some(800.0), Some(2000.0)), Some(800.0));
        assert_eq!(ttft_budget_ms(None, Some(2000.0)), Some(2000.0));
        assert_eq!(ttft_budget_ms(Some(800.0), None), Some(800.0));
        assert_eq!(ttft_budget_ms(None, None), None);
    }

    #[test]
    fn with_no_budget_to_shed_by_the_wait_is_not_held_to_one() {
        // `over_budget = "queue"` (or no budget set): Terms carries none,
        // and 600 ms of wait with a 500 ms TTFT queues until the deadline.
        let s = Snapshot {
            recent_ttft_p95_ms: Some(500.0),
            ..full(600.0, 100.0)
        };
        assert_eq!(
            decide(&s, &terms(5000.0)),
            Decision::Queue {
                max_wait_ms: 5000.0,
                bound: QueueBound::Deadline
            }
        );
    }

    #[test]
    fn the_queue_age_bounds_the_wait() {
        assert_eq!(
            decide(&full(100.0, 100.0), &terms(60_000.0)),
            Decision::Queue {
                max_wait_ms: 30_000.0,
                bound: QueueBound::QueueAge
            }
        );
    }

    #[test]
    fn nothing_measured_sheds_nothing() {
        // No wait estimate yet: neither the deadline nor the budget can
        // refuse; a budget smaller than the expected TTFT leaves no wait.
        let s = Snapshot {
            fit: Err(Refusal::Global),
            ..idle()
        };
        let t = Terms {
            ttft_budget_ms: Some(200.0),
            expected_ttft_ms: Some(300.0),
            ..terms(100.0)
        };
        assert_eq!(
            decide(&s, &t),
            Decision::Queue {
                max_wait_ms: 0.0,
                bound: QueueBound::TtftBudget
            }
        );
    }

    #[test]
    fn refusals_in_their_order() {
        let all = Snapshot {
            draining: true,
            reject_new: true,
            fit: Err(Refusal::NeverFits),
            ..full(1e9, 1e9)
        };
        let t = terms(1.0);
        assert_eq!(decide(&all, &t), Decision::Shed(Shed::Draining));
        let s = Snapshot {
            draining: false,
            ..all
        };
        assert_eq!(decide(&s, &t), Decision::Shed(Shed::RejectNew));
        let s = Snapshot {
            reject_new: false,
            ..s
        };
        assert_eq!(decide(&s, &t), Decision::Shed(Shed::NeverFits));
        let s = Snapshot {
            fit: Err(Refusal::Tightened),
            ..s
        };
        assert_eq!(decide(&s, &t), Decision::Shed(Shed::Tightened));
        // A tenant over its burst share waits like any other full node.
        for why in [Refusal::TenantBurst, Refusal::OthersGuarantee] {
            let s = Snapshot {
                fit: Err(why),
                wait_ms: None,
                ..s
            };
            assert!(matches!(decide(&s, &t), Decision::Queue { .. }));
        }
    }
}
