//! Timers reused from one request to the next: hyper's timer for the
//! client connections (each request's header-read timer), and the
//! governor's wait for an upstream's answer.
//!
//! hyper arms a header-read timer whenever a connection waits for a
//! request's head and drops it once the head is read: one timer made,
//! registered in tokio's wheel and taken out of it again a request (with
//! hyper-util's `TokioTimer`). Here a dropped timer goes back to a spare
//! list still registered, and the next head's timer is that one moved to
//! a later deadline, which tokio does without touching the wheel. The
//! wait for an upstream's head did the same with `tokio::time::timeout`
//! (both measured: docs/measurements/2026-12-06-governor-code-figures.md). A spare
//! timer that expires wakes the task that last waited on it, which is a
//! no-op once that task moved on.

use hyper::rt::{Sleep, Timer};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Most spare timers kept (more are dropped as usual).
const SPARE: usize = 1024;

type Spare = Arc<Mutex<Vec<Pin<Box<tokio::time::Sleep>>>>>;

/// A [`Timer`] on tokio's that reuses the timers hyper drops. Belongs to
/// one server (its runtime): the spare timers are registered with it.
#[derive(Clone, Default)]
pub(crate) struct ReusingTimer {
    spare: Spare,
}

/// A timer from [`ReusingTimer::sleep_until`]: back to the spares when
/// dropped.
pub(crate) struct Reused {
    inner: Option<Pin<Box<tokio::time::Sleep>>>,
    spare: Spare,
}

impl Future for Reused {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.inner.as_mut() {
            Some(s) => s.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Sleep for Reused {}

impl Drop for Reused {
    fn drop(&mut self) {
        if let (Some(s), Ok(mut spare)) = (self.inner.take(), self.spare.lock()) {
            if spare.len() < SPARE {
                spare.push(s);
            }
        }
    }
}

impl ReusingTimer {
    /// A timer that completes at `deadline`: a spare one moved there, or
    /// a new one.
    pub(crate) fn sleep_until(&self, deadline: impl Into<tokio::time::Instant>) -> Reused {
        let deadline = deadline.into();
        let kept = self.spare.lock().ok().and_then(|mut s| s.pop());
        let inner = match kept {
            Some(mut s) => {
                s.as_mut().reset(deadline);
                s
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        Reused {
            inner: Some(inner),
            spare: self.spare.clone(),
        }
    }
}

impl Timer for ReusingTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        Timer::sleep_until(self, self.now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        Box::pin(ReusingTimer::sleep_until(self, deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<Reused>() {
            Some(r) => match r.get_mut().inner.as_mut() {
                Some(s) => s.as_mut().reset(new_deadline.into()),
                None => *sleep = Timer::sleep_until(self, new_deadline),
            },
            None => *sleep = Timer::sleep_until(self, new_deadline),
        }
    }

    fn now(&self) -> Instant {
        tokio::time::Instant::now().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_reused_timer_fires_at_its_new_deadline() {
        let t = ReusingTimer::default();
        let start = t.now();
        // A timer dropped before its deadline goes back to the spares...
        drop(Timer::sleep_until(&t, start + Duration::from_secs(1)));
        assert_eq!(t.spare.lock().unwrap().len(), 1);
        // ...and the next one is it, at the later deadline: not earlier.
        let mut s = Timer::sleep_until(&t, start + Duration::from_secs(5));
        assert!(t.spare.lock().unwrap().is_empty());
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            futures::poll!(s.as_mut()).is_pending(),
            "fired at the old deadline"
        );
        s.await;
        assert_eq!(t.now() - start, Duration::from_secs(5));
        // A deadline earlier than a spare's is kept too.
        drop(Timer::sleep_until(&t, t.now() + Duration::from_secs(10)));
        let s = Timer::sleep_until(&t, t.now() + Duration::from_millis(10));
        let before = t.now();
        s.await;
        assert_eq!(t.now() - before, Duration::from_millis(10));
    }

    #[tokio::test(start_paused = true)]
    async fn reset_moves_the_deadline() {
        let t = ReusingTimer::default();
        let start = t.now();
        let mut s = Timer::sleep_until(&t, start + Duration::from_secs(1));
        t.reset(&mut s, start + Duration::from_secs(3));
        s.await;
        assert_eq!(t.now() - start, Duration::from_secs(3));
    }
}
