//! Admission without waiting (`GovernedUpstream::try_place`, for a
//! caller with another upstream to try): admit now or say it does not
//! fit; and how full the upstream is.

use super::decide::{decide, Decision, Shed, Terms};
use super::{Ask, Governor, Permit};
use crate::error::GovernError;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Governor {
    /// Admits now or not at all: `Ok(None)` when the request does not fit
    /// right now for any reason that passes (the caps, the guard, the
    /// queue, other requests), so the caller can try another upstream
    /// before anything is refused. Nothing is queued.
    ///
    /// # Errors
    /// 503 while draining; 400 if it can never fit this upstream.
    pub fn try_admit(self: &Arc<Self>, ask: Ask) -> Result<Option<Permit>, GovernError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(GovernError::Draining);
        }
        let now_ms = self.now_ms();
        let mut g = self.lock();
        let snapshot = self.snapshot(&mut g, now_ms, &ask);
        // Only what no other upstream could change is refused here.
        let no_wait = Terms {
            left_ms: 0.0,
            max_queue_age_ms: 0.0,
            ttft_budget_ms: None,
            expected_ttft_ms: None,
        };
        match decide(&snapshot, &no_wait) {
            Decision::AdmitNow => {
                // Checked by the snapshot, under the same lock.
                g.ledger.commit(&ask.tenant, ask.demand);
                let p = self.permit(&mut g, &ask.tenant, ask.demand, ask.charges, Duration::ZERO);
                self.publish(&g);
                Ok(Some(p))
            }
            Decision::Shed(Shed::Draining) => Err(GovernError::Draining),
            Decision::Shed(Shed::NeverFits) => Err(Self::never_fits_error(&g, &ask)),
            Decision::Shed(_) | Decision::Queue { .. } => Ok(None),
        }
    }

    /// The share of this upstream's envelope reserved now (0..1, the most
    /// used of sequences, KV tokens and capacity units): how full it is.
    pub fn fullness(&self) -> f64 {
        let g = self.lock();
        let cap = g.ledger.capacity();
        let used = g.ledger.used();
        let f = |u: u64, c: u64| if c == 0 { 1.0 } else { u as f64 / c as f64 };
        f(used.seqs, cap.seqs)
            .max(f(used.kv_tokens, cap.kv_tokens))
            .max(f(used.capacity, cap.capacity))
    }
}
