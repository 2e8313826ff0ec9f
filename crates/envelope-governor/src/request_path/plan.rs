//! The planned stage: one pure function of the profile's limits, the caps
//! in force now (a live guard may have lowered them), the budget's output
//! per sequence and the counted request. What can never fit the profile
//! is refused for good (4xx); what fits it but not today's caps waits or
//! is deferred ([`Planned::NotNow`]), never refused for good.

use crate::error::{GovernError, OverloadReason};
use crate::policy::{self, Plan};
use crate::request::{Endpoint, OutputDecision};
use crate::settings::{Beyond, OverLimit};
use crate::tokens::CountSource;
use envelope_profile::Limits;

/// Everything a plan is made of, as plain values.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlanInputs<'a> {
    /// The profile's limits: what can ever fit.
    pub profile: &'a Limits,
    /// The caps in force now.
    pub current: &'a Limits,
    pub over_limit: OverLimit,
    pub beyond: Beyond,
    pub endpoint: Endpoint,
    /// Prompt tokens per group, and how they were counted.
    pub counts: &'a [u64],
    /// Prompt tokens per group credited as in the upstream's prefix cache
    /// ([`crate::prefix_cache`]).
    pub cached: &'a [u64],
    pub source: CountSource,
    /// The request's `max_tokens` and `n`.
    pub max_tokens: Option<u64>,
    pub n: u64,
    /// With budgets over time, the most output each of the request's
    /// sequences could be billed ([`crate::budget::Budgets::output_per_seq`]).
    pub output_per_seq: Option<u64>,
    /// How long counting could take (for the message of a count that
    /// timed out).
    pub count_timeout_ms: u64,
}

/// A plan, or why it must wait.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Planned {
    /// Fits the profile and today's caps.
    Now(Plan),
    /// Fits the profile but not today's caps, and the client's own
    /// `max_tokens` is never shortened: the request waits for the caps to
    /// recover, or is deferred (429).
    NotNow(Plan),
}

/// Plans a request.
///
/// # Errors
/// What can never fit the profile (400, or 413 for a `max_tokens` over
/// it when over-limit requests are refused). A prompt counted by the
/// bound estimate after a count timeout is never refused for good: not
/// fitting by an upper bound is a 429 (come back when it can be counted).
pub(crate) fn plan_request(i: &PlanInputs<'_>) -> Result<Planned, GovernError> {
    let plan_for = |limits: &Limits, max_tokens: Option<u64>| {
        policy::plan_cached(
            limits,
            i.over_limit,
            i.beyond,
            i.endpoint,
            i.counts,
            i.cached,
            max_tokens,
            i.n,
        )
    };
    let mut plan = match plan_for(i.profile, i.max_tokens) {
        Ok(p) => p,
        Err(e) if i.source == CountSource::EstimateAfterTimeout && e.status().is_client_error() => {
            return Err(GovernError::Overloaded {
                reason: OverloadReason::CountTimeout,
                retry_after_s: 1,
                message: format!(
                    "the prompt could not be counted within {} ms, and by its bytes alone it may not fit ({e}); retry",
                    i.count_timeout_ms
                ),
            });
        }
        Err(e) => return Err(e),
    };
    // A max_tokens the governor chose (injected or clamped) follows
    // today's caps; one the client asked for waits for them.
    let chosen = plan.decision != OutputDecision::Kept;
    if !plan.fits(i.current) {
        let shorter = chosen
            .then(|| plan_for(i.current, i.max_tokens).ok())
            .flatten()
            .filter(|p| p.fits(i.current));
        match shorter {
            Some(p) => plan = p,
            None => return Ok(Planned::NotNow(plan)),
        }
    }
    // A max_tokens the governor chose also fits the tightest output
    // budget, rather than reserve more of it than the budget holds.
    let fitted = i
        .output_per_seq
        .filter(|&per_seq| chosen && plan.max_tokens > per_seq)
        .and_then(|per_seq| plan_for(i.profile, Some(per_seq)).ok())
        .filter(|p| p.fits(i.current));
    if let Some(p) = fitted {
        plan = Plan {
            decision: plan.decision,
            ..p
        };
    }
    Ok(Planned::Now(plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Context 100, output 30, one bucket.
    fn profile() -> Limits {
        let mut l = Limits {
            max_context_tokens: 100,
            max_output_tokens: 30,
            max_concurrent_seqs: 4,
            max_kv_tokens_in_flight: 1000,
            buckets: vec![],
        };
        l.buckets = vec![l.single_row()];
        l
    }

    fn inputs<'a>(
        profile: &'a Limits,
        current: &'a Limits,
        counts: &'a [u64],
        max_tokens: Option<u64>,
    ) -> PlanInputs<'a> {
        PlanInputs {
            profile,
            current,
            over_limit: OverLimit::Clamp,
            beyond: Beyond::Refuse,
            endpoint: Endpoint::Chat,
            counts,
            cached: &[],
            source: CountSource::Tokenizer,
            max_tokens,
            n: 1,
            output_per_seq: None,
            count_timeout_ms: 250,
        }
    }

    fn now(r: Result<Planned, GovernError>) -> Plan {
        match r {
            Ok(Planned::Now(p)) => p,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn within_the_caps_a_request_is_planned_now() {
        let l = profile();
        let p = now(plan_request(&inputs(&l, &l, &[10], None)));
        assert_eq!((p.max_tokens, p.decision), (30, OutputDecision::Injected));
        let p = now(plan_request(&inputs(&l, &l, &[10], Some(12))));
        assert_eq!((p.max_tokens, p.decision), (12, OutputDecision::Kept));
    }

    #[test]
    fn lowered_caps_shorten_a_chosen_output_and_defer_an_asked_one() {
        let l = profile();
        let mut lowered = l.clone();
        (lowered.max_context_tokens, lowered.max_output_tokens) = (50, 15);
        // Injected: follows today's caps.
        let p = now(plan_request(&inputs(&l, &lowered, &[10], None)));
        assert_eq!((p.max_tokens, p.decision), (15, OutputDecision::Injected));
        // Asked for 20 (within the profile): never shortened, waits.
        match plan_request(&inputs(&l, &lowered, &[10], Some(20))) {
            Ok(Planned::NotNow(p)) => assert_eq!(p.max_tokens, 20),
            other => panic!("{other:?}"),
        }
        // A prompt over today's context but within the profile's: waits,
        // even with an output the governor chose.
        match plan_request(&inputs(&l, &lowered, &[60], None)) {
            Ok(Planned::NotNow(_)) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn what_never_fits_the_profile_is_refused_for_good() {
        let l = profile();
        match plan_request(&inputs(&l, &l, &[100], None)) {
            Err(e @ GovernError::ContextLength { .. }) => assert_eq!(e.status().as_u16(), 400),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_count_that_timed_out_is_deferred_not_refused() {
        let l = profile();
        let mut i = inputs(&l, &l, &[100], None);
        i.source = CountSource::EstimateAfterTimeout;
        match plan_request(&i) {
            Err(e @ GovernError::Overloaded { .. }) => {
                assert_eq!(e.status().as_u16(), 429);
                assert!(e.to_string().contains("250 ms"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_output_budget_shortens_only_a_chosen_output() {
        let l = profile();
        let mut i = inputs(&l, &l, &[10], None);
        i.output_per_seq = Some(8);
        let p = now(plan_request(&i));
        assert_eq!((p.max_tokens, p.decision), (8, OutputDecision::Injected));
        // The client's own 20 is kept (the budget decides on it later).
        i.max_tokens = Some(20);
        let p = now(plan_request(&i));
        assert_eq!((p.max_tokens, p.decision), (20, OutputDecision::Kept));
        // A budget roomier than the plan changes nothing.
        i.max_tokens = None;
        i.output_per_seq = Some(100);
        assert_eq!(now(plan_request(&i)).max_tokens, 30);
    }
}
