//! The settled stage: every ending of an admitted request (a whole answer,
//! one cut short, a client gone, an upstream never reached or silent) is
//! one [`Settlement`], and [`Held::settle`] is the one place that acts on
//! it: the budgets are billed what was used (or refunded), the latency
//! guard gets its sample, the permit records the tokens used, and the
//! permit is released.

use crate::admission::Permit;
use crate::budget::{Hold, Used};
use crate::error::GovernError;

/// What an admitted request holds until its answer ends: its place in
/// the envelope and, with budgets over time, its reservation of them.
pub(crate) struct Held {
    pub permit: Permit,
    pub budget: Option<Hold>,
    /// Prompt tokens estimated in the upstream's prefix cache, of
    /// `prompt_tokens` counted.
    pub estimated_cached: u64,
    pub prompt_tokens: u64,
}

/// How an admitted request's answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The upstream was never reached: the budgets get everything back.
    NotSent,
    /// The whole answer, as the upstream sent it.
    Whole,
    /// Cut short once sent: an upstream error or silence (before the head
    /// or after), the request's lifetime, the drain, or a client gone.
    /// The upstream may have done the work.
    Cut,
}

/// How an answer ended and what it used, as far as the governor saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Settlement {
    pub ending: Ending,
    /// The upstream answered with an error status: no tokens were used
    /// (the request still counts against request budgets).
    pub refused_by_upstream: bool,
    /// The `usage` numbers the answer ended with.
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, where the answer gives it.
    pub cached_tokens: Option<u64>,
    /// SSE data events seen, for a stream (about one a token, and a
    /// closing `[DONE]` on a whole one); `None` for a whole body.
    pub events: Option<u64>,
    /// The latency guard's sample, in ms: TTFT and mean gap between
    /// events of a stream, or the time of a whole body. `None` where the
    /// timings say nothing of the upstream (a slow reader, an answer that
    /// did not end whole or was an error).
    pub latency: Option<(Option<f64>, Option<f64>, Option<f64>)>,
}

impl Settlement {
    /// An answer that ended as `ending`, nothing yet known of its usage.
    pub(crate) fn ended(ending: Ending) -> Settlement {
        Settlement {
            ending,
            refused_by_upstream: false,
            prompt_tokens: None,
            completion_tokens: None,
            cached_tokens: None,
            events: None,
            latency: None,
        }
    }

    /// A send that failed before the answer's head: never reached when
    /// the connection failed, else (no head in time, the drain) cut.
    pub(crate) fn of_failed_send(e: &GovernError) -> Settlement {
        Settlement::ended(match e {
            GovernError::UpstreamUnreachable(_) => Ending::NotSent,
            _ => Ending::Cut,
        })
    }

    /// Output tokens billed against a reservation of `reserved`: the
    /// answer's `usage`; else, for a stream, one data event per token (less
    /// the closing `[DONE]` of a whole one, at most what was reserved);
    /// else everything reserved.
    pub(crate) fn output_tokens(&self, reserved: u64) -> u64 {
        match (self.completion_tokens, self.events) {
            (Some(c), _) => c,
            (None, Some(events)) => {
                let done = u64::from(self.ending == Ending::Whole).min(events);
                (events - done).min(reserved)
            }
            (None, None) => reserved,
        }
    }

    /// Tokens the request used, for the permit: prompt and completion by
    /// `usage`, else a stream's data events less the `[DONE]`.
    pub(crate) fn used_tokens(&self) -> Option<u64> {
        match (self.prompt_tokens, self.completion_tokens) {
            (Some(p), Some(c)) => Some(p + c),
            _ => self.events.map(|e| e.saturating_sub(1)),
        }
    }
}

impl Held {
    /// Settles the request by how its answer ended, and releases it.
    pub(crate) fn settle(self, s: &Settlement) {
        let Held {
            mut permit,
            budget,
            estimated_cached,
            prompt_tokens,
        } = self;
        if let Some(hold) = budget {
            match s.ending {
                Ending::NotSent => hold.refund(),
                _ if s.refused_by_upstream => hold.refused_upstream(),
                _ => {
                    let r = hold.reserved();
                    hold.settle(Used {
                        input_tokens: s.prompt_tokens.unwrap_or(r.input_tokens),
                        output_tokens: s.output_tokens(r.output_tokens),
                    });
                }
            }
        }
        if s.ending == Ending::Whole && !s.refused_by_upstream {
            // What the upstream says it found, against what was estimated.
            if let Some(reported) = s.cached_tokens {
                permit.answered_cached(estimated_cached, reported, prompt_tokens);
            }
        }
        if s.ending == Ending::Whole {
            if let Some((ttft, itl, e2e)) = s.latency.filter(|_| !s.refused_by_upstream) {
                permit.record_latency(ttft, itl, e2e);
            }
            if let Some(used) = s.used_tokens() {
                permit.settle(used);
            }
        }
        // The permit is released here.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(ending: Ending, events: u64) -> Settlement {
        Settlement {
            events: Some(events),
            ..Settlement::ended(ending)
        }
    }

    #[test]
    fn output_is_billed_by_usage_then_events_then_the_reservation() {
        let with_usage = Settlement {
            completion_tokens: Some(7),
            ..stream(Ending::Cut, 50)
        };
        assert_eq!(with_usage.output_tokens(100), 7);
        // A whole stream ends with `[DONE]`, which is no token; a cut one
        // has none. Never more than was reserved.
        assert_eq!(stream(Ending::Whole, 11).output_tokens(100), 10);
        assert_eq!(stream(Ending::Cut, 11).output_tokens(100), 11);
        assert_eq!(stream(Ending::Whole, 500).output_tokens(100), 100);
        assert_eq!(stream(Ending::Whole, 0).output_tokens(100), 0);
        // A body without usage: what was reserved.
        assert_eq!(Settlement::ended(Ending::Whole).output_tokens(100), 100);
    }

    #[test]
    fn used_tokens_come_from_usage_or_events() {
        let whole = Settlement {
            prompt_tokens: Some(20),
            completion_tokens: Some(5),
            ..Settlement::ended(Ending::Whole)
        };
        assert_eq!(whole.used_tokens(), Some(25));
        assert_eq!(stream(Ending::Whole, 6).used_tokens(), Some(5));
        assert_eq!(Settlement::ended(Ending::Whole).used_tokens(), None);
    }

    #[test]
    fn only_a_failed_connection_is_never_reached() {
        let unreachable = GovernError::UpstreamUnreachable("x".into());
        let silent = GovernError::UpstreamTimeout("x".into());
        assert_eq!(
            Settlement::of_failed_send(&unreachable).ending,
            Ending::NotSent
        );
        assert_eq!(Settlement::of_failed_send(&silent).ending, Ending::Cut);
        assert_eq!(
            Settlement::of_failed_send(&GovernError::Draining).ending,
            Ending::Cut
        );
    }
}
