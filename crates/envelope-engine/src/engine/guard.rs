//! The panic boundary around a step: a bug that panics inside one forward
//! pass (an `expect`, an index out of range, a kernel wrapper's assert)
//! fails the requests of that step, not the engine every client shares.

use super::{Engine, Event, Sequence, StepRunner, StepStats};
use crate::error::{EngineError, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

impl Engine {
    /// [`Engine::step`], with a panic in it turned into an error: the
    /// sequences of the step get [`Event::Error`] and leave the scheduler
    /// (their blocks are freed), and the engine goes on with the rest. A
    /// panic before the step had chosen its sequences (in the scheduler
    /// itself) fails every sequence, since no state can be trusted then,
    /// and it would otherwise repeat on every step.
    pub fn step_guarded(&mut self) -> Result<StepStats> {
        let payload = match catch_unwind(AssertUnwindSafe(|| self.step())) {
            Ok(r) => return r,
            Err(p) => p,
        };
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        let mut failed = std::mem::take(&mut self.stepping);
        if failed.is_empty() {
            failed = self.seqs.keys().copied().collect();
        }
        let message = format!("the engine failed in this request's step: {what}");
        let removed: Vec<Sequence> = failed
            .iter()
            .filter_map(|id| {
                self.scheduler.remove(*id);
                self.seqs.remove(id)
            })
            .collect();
        // Counted and published before anyone hears of it: a client that
        // gets the error and reads the metrics sees the panic and the
        // freed blocks.
        self.metrics
            .step_panics_total
            .fetch_add(1, Ordering::Relaxed);
        self.publish();
        for s in removed {
            let _ = s.tx.send(Event::Error(message.clone()));
        }
        Err(EngineError::StepPanicked {
            message: what,
            failed: failed.len(),
        })
    }

    /// Replaces the step runner with `wrap(runner)`: for runners that add
    /// to another (fault injection in tests, tracing).
    pub fn wrap_runner(
        mut self,
        wrap: impl FnOnce(Box<dyn StepRunner>) -> Box<dyn StepRunner>,
    ) -> Engine {
        self.runner = wrap(self.runner);
        self
    }
}
