//! A queued request's wait for its turn, apart from [`Governor::admit`]
//! so that only a request that waits carries its future (a timer, a
//! channel): one admitted at once does not.

use super::decide::QueueBound;
use super::{Ask, Governor, OverloadReason, Permit};
use crate::error::GovernError;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Removes a queued entry when the waiting future is dropped (client gone).
struct Ticket<'a> {
    gov: &'a Governor,
    id: u64,
    armed: bool,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut g = self.gov.lock();
            g.queue.remove(self.id);
            self.gov.publish(&g);
        }
    }
}

impl Governor {
    /// Waits for a queued request's turn, until `wait_until`.
    pub(super) async fn wait_queued(
        self: &Arc<Self>,
        id: u64,
        rx: oneshot::Receiver<Result<Permit, GovernError>>,
        wait_until: Instant,
        bound: QueueBound,
        ask: &Ask,
        now: Instant,
    ) -> Result<Permit, GovernError> {
        let mut ticket = Ticket {
            gov: self,
            id,
            armed: true,
        };
        let mut rx = rx;
        let got = tokio::time::timeout_at(wait_until.into(), &mut rx).await;
        let result = match got {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(GovernError::Draining),
            Err(_) => {
                // Timed out; it may have been granted at the same instant.
                let removed = {
                    let mut g = self.lock();
                    let r = g.queue.remove(id).is_some();
                    self.publish(&g);
                    r
                };
                if removed {
                    let mut g = self.lock();
                    let ra = Self::retry_after(&mut g, self.now_ms(), ask.class, ask.demand);
                    let (reason, why) = if bound == QueueBound::TtftBudget {
                        (OverloadReason::TtftBudget, "its TTFT budget is spent")
                    } else {
                        (OverloadReason::QueueTimeout, "without fitting")
                    };
                    Err(Self::overloaded(
                        reason,
                        ra,
                        format!(
                            "waited {} ms in the admission queue (it could wait {} ms): {why}",
                            now.elapsed().as_millis(),
                            wait_until.saturating_duration_since(now).as_millis()
                        ),
                    ))
                } else {
                    // Granted as the wait ran out: the wake-up is on its
                    // way (sent right after the lock is released).
                    rx.await.unwrap_or(Err(GovernError::Draining))
                }
            }
        };
        ticket.armed = false;
        if let Ok(p) = &result {
            self.metrics.queue_age.observe(p.queued_for.as_secs_f64());
        }
        result
    }
}
