//! What a refusal or a failed answer on one tier leads to, as two tables:
//! [`next_move`] while a call is being placed (the next upstream, the next
//! tier, the tiers above, or the refusal to the caller), and
//! [`which_stands`] once a call has been escalated (the answer from the
//! tier up, the lower answer, or the tier up's refusal). `call.rs` acts on
//! them; the tests below are the tables.

use super::config::OutOfTime;
use envelope_governor::error::GovernError;

/// A refusal or failure, by what it says about the other places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// The call does not fit this place's profile at all (a larger one
    /// may take it): over the context, the output, the envelope, the
    /// capacity.
    NeverFits,
    /// The upstream could not be reached or did not answer in time.
    UpstreamFailed,
    /// Anything else (a bad request, the caller's budget, a deadline):
    /// the same everywhere.
    Other,
}

impl Failure {
    pub(super) fn of(e: &GovernError) -> Failure {
        match e {
            GovernError::ContextLength { .. }
            | GovernError::BeyondEnvelope { .. }
            | GovernError::NeverFits { .. }
            | GovernError::OutputTooLong { .. } => Failure::NeverFits,
            GovernError::UpstreamUnreachable(_) | GovernError::UpstreamTimeout(_) => {
                Failure::UpstreamFailed
            }
            _ => Failure::Other,
        }
    }
}

/// Where the failure happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tried {
    /// One upstream of a tier (the tier has others to try).
    Upstream,
    /// A tier with room now: the call's starting tier or a fallback.
    /// `alone`: no fallback tier is tried after the start (pinned, or
    /// none configured).
    TierNow { start: bool, alone: bool },
    /// A tier the call waits on (its own, or one above it when it can
    /// never fit its own).
    TierWaiting,
}

/// What the placement does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Move {
    /// The next upstream of the tier, or the next tier in the list; the
    /// failure is kept as the answer if none takes the call.
    Next,
    /// The call can never fit its starting tier: after the fallbacks, it
    /// waits on the tiers above instead of its own.
    Above,
    /// The failure goes to the caller.
    Refuse,
}

/// The placement's table.
pub(super) fn next_move(tried: Tried, failure: Failure) -> Move {
    use {Failure::*, Move::*, Tried::*};
    match (tried, failure) {
        (_, Other) => Refuse,
        // Another upstream of the tier may count the prompt, or have a
        // larger profile.
        (Upstream, NeverFits | UpstreamFailed) => Next,
        (TierNow { start: true, .. }, NeverFits) => Above,
        (TierNow { start: false, .. }, NeverFits) => Next,
        // A tier whose upstreams cannot even count the prompt has no room
        // now; another tier may, when there is one to try.
        (
            TierNow {
                start: true,
                alone: true,
            },
            UpstreamFailed,
        ) => Refuse,
        (TierNow { .. }, UpstreamFailed) => Next,
        (TierWaiting, NeverFits) => Next,
        (TierWaiting, UpstreamFailed) => Refuse,
    }
}

/// How the tier up answered an escalated call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Upper {
    /// An answer with a 5xx status.
    ServerError,
    /// Any other answer (the tier up's checks are not looked at again).
    Answered,
    /// Refused or failed before an answer (no room within the deadline,
    /// unreachable).
    Refused,
}

/// How the starting tier answered the call first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Lower {
    /// A 2xx answer that failed a check.
    Success,
    /// An answer with another status.
    OtherStatus,
    /// No answer (the upstream failed).
    None,
}

/// Which answer the caller gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stands {
    /// The tier up's answer: the call is escalated.
    Upper,
    /// The lower answer, with the escalation's failure in a header.
    Lower,
    /// The tier up's refusal.
    Refusal,
}

/// The escalation's table. `out_of_time` says whether a lower answer
/// stands when the tier up cannot give a usable one.
pub(super) fn which_stands(upper: Upper, lower: Lower, out_of_time: OutOfTime) -> Stands {
    let keep_lower = out_of_time == OutOfTime::LowerAnswer;
    match (upper, lower) {
        // The tier up failed outright: a usable lower answer stands.
        (Upper::ServerError, Lower::Success) if keep_lower => Stands::Lower,
        (Upper::ServerError | Upper::Answered, _) => Stands::Upper,
        // No answer from the tier up: any lower answer stands.
        (Upper::Refused, Lower::Success | Lower::OtherStatus) if keep_lower => Stands::Lower,
        (Upper::Refused, _) => Stands::Refusal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envelope_governor::error::OverloadReason;

    #[test]
    fn failures_by_kind() {
        let never = GovernError::OutputTooLong {
            asked: 4096,
            limit: 2048,
        };
        assert_eq!(Failure::of(&never), Failure::NeverFits);
        let gone = GovernError::UpstreamUnreachable("refused".into());
        assert_eq!(Failure::of(&gone), Failure::UpstreamFailed);
        let late = GovernError::Overloaded {
            reason: OverloadReason::DeadlineUnmeetable,
            retry_after_s: 1,
            message: "late".into(),
        };
        assert_eq!(Failure::of(&late), Failure::Other);
        assert_eq!(Failure::of(&GovernError::Draining), Failure::Other);
    }

    #[test]
    fn the_placement_table() {
        use {Failure::*, Move::*, Tried::*};
        let start = |alone| TierNow { start: true, alone };
        let fallback = TierNow {
            start: false,
            alone: false,
        };
        let table = [
            (Upstream, NeverFits, Next),
            (Upstream, UpstreamFailed, Next),
            (Upstream, Other, Refuse),
            (start(false), NeverFits, Above),
            (start(true), NeverFits, Above),
            (start(false), UpstreamFailed, Next),
            (start(true), UpstreamFailed, Refuse),
            (start(false), Other, Refuse),
            (fallback, NeverFits, Next),
            (fallback, UpstreamFailed, Next),
            (fallback, Other, Refuse),
            (TierWaiting, NeverFits, Next),
            (TierWaiting, UpstreamFailed, Refuse),
            (TierWaiting, Other, Refuse),
        ];
        for (tried, failure, want) in table {
            assert_eq!(next_move(tried, failure), want, "{tried:?}, {failure:?}");
        }
    }

    #[test]
    fn the_escalation_table() {
        use {Lower as L, OutOfTime::*, Stands as S, Upper as U};
        let table = [
            (U::Answered, L::Success, LowerAnswer, S::Upper),
            (U::Answered, L::None, LowerAnswer, S::Upper),
            (U::Answered, L::Success, Error, S::Upper),
            (U::ServerError, L::Success, LowerAnswer, S::Lower),
            (U::ServerError, L::OtherStatus, LowerAnswer, S::Upper),
            (U::ServerError, L::None, LowerAnswer, S::Upper),
            (U::ServerError, L::Success, Error, S::Upper),
            (U::Refused, L::Success, LowerAnswer, S::Lower),
            (U::Refused, L::OtherStatus, LowerAnswer, S::Lower),
            (U::Refused, L::None, LowerAnswer, S::Refusal),
            (U::Refused, L::Success, Error, S::Refusal),
            (U::Refused, L::None, Error, S::Refusal),
        ];
        for (upper, lower, out_of_time, want) in table {
            assert_eq!(
                which_stands(upper, lower, out_of_time),
                want,
                "{upper:?}, {lower:?}, {out_of_time:?}"
            );
        }
    }
}
