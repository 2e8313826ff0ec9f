//! The admitted stage: [`place`] takes a read and counted request through
//! its plan and budget reservation to a permit from the admission queue.

use super::{
    plan_request, reserve, Counted, GovernedUpstream, Held, Incoming, PlanInputs, Planned,
};
use crate::admission::{Ask, Permit};
use crate::error::GovernError;
use crate::identity::Identity;
use crate::policy;
use crate::settings::Settings;
use crate::tokens::CountSource;
use std::time::Instant;

/// Whether placing a request may wait in the admission queue
/// ([`GovernedUpstream::place`] or [`GovernedUpstream::try_place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Admit now or not at all (`Ok(None)`).
    No,
    /// Queue until the request's deadline.
    UntilDeadline,
}

/// A request placed on one upstream: its admission, its budget
/// reservation (with budgets over time), and what was planned.
pub struct Placed {
    pub permit: Permit,
    pub budget: Option<crate::budget::Hold>,
    pub plan: policy::Plan,
    pub source: CountSource,
    /// Prompt tokens the governor estimated in the upstream's prefix cache
    /// (before trust: what the answer's report is held against).
    pub estimated_cached: u64,
}

impl Placed {
    /// What rides with the answer until it is settled.
    pub(crate) fn held(self) -> Held {
        Held {
            permit: self.permit,
            budget: self.budget,
            estimated_cached: self.estimated_cached,
            prompt_tokens: self.plan.prompt_tokens,
        }
    }
}

/// Plans, reserves and admits `inc`, counted as `counted`, on the upstream
/// behind `s`, to be answered by `deadline`.
///
/// # Errors
/// What the governor refuses: a request that can never fit the profile
/// (4xx), one that fits the profile but not today's caps, its budgets or
/// the queue (429), draining (503). With [`Wait::No`], a request that
/// does not fit right now is `Ok(None)` instead of a 429.
pub(crate) async fn place(
    s: &GovernedUpstream,
    settings: &Settings,
    inc: &Incoming,
    counted: &Counted,
    who: &Identity,
    wait: Wait,
    deadline: Instant,
) -> Result<Option<Placed>, GovernError> {
    let parsed = &inc.parsed;
    let source = counted.source;
    s.gov
        .metrics
        .token_counts
        .inc(source as usize, source.label());
    let budgets = settings.budgets.as_ref();
    let feature = inc.feature.as_deref();
    let seqs = policy::sequences(counted.counts.len(), parsed.n);
    let current = s.gov.limits();
    // What the upstream's prefix cache probably holds of the prompt, as
    // far as its reports let the governor believe it.
    let prefix = s
        .gov
        .prefix
        .estimate(&who.tenant, &parsed.prompts, &counted.counts);
    let planned = plan_request(&PlanInputs {
        profile: &settings.limits,
        current: &current,
        over_limit: settings.over_limit,
        beyond: settings.beyond,
        endpoint: parsed.endpoint,
        counts: &counted.counts,
        cached: &prefix.credited,
        source,
        max_tokens: parsed.max_tokens,
        n: parsed.n,
        output_per_seq: budgets.and_then(|b| b.output_per_seq(&who.tenant, feature, seqs)),
        count_timeout_ms: settings.counting.count_timeout_ms,
    })?;
    let plan = match (planned, wait) {
        (Planned::Now(p), _) => p,
        (Planned::NotNow(_), Wait::No) => return Ok(None),
        (Planned::NotNow(p), Wait::UntilDeadline) => {
            return Err(s.gov.tightened(who.class, p.demand))
        }
    };
    let expected_ttft_ms = plan
        .charges
        .iter()
        .filter_map(|c| settings.limits.buckets.get(c.bucket))
        .filter_map(|b| b.ttft_p95_ms)
        .reduce(f64::max);
    let budget = match budgets {
        None => None,
        Some(b) => reserve(s, b, &who.tenant, feature, &plan).await?,
    };
    let ask = Ask {
        tenant: who.tenant.clone(),
        class: who.class,
        deadline,
        demand: plan.demand,
        charges: plan.charges.clone(),
        expected_ttft_ms,
        ttft_objective_ms: inc.slo_ttft_ms,
    };
    // Not admitted: the hold drops unsent and gives everything back.
    let permit = match wait {
        Wait::UntilDeadline => s.gov.admit(ask).await?,
        Wait::No => match s.gov.try_admit(ask)? {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    s.gov.prefix.sent(&prefix, plan.prompt_tokens);
    let m = &s.gov.metrics;
    m.prefix_estimated_tokens.inc_by(prefix.estimated_total());
    m.prefix_credited_tokens.inc_by(plan.cached_tokens);
    m.output_decisions
        .inc(plan.decision as usize, plan.decision.label());
    m.admitted
        .inc(parsed.endpoint as usize, parsed.endpoint.label());
    Ok(Some(Placed {
        permit,
        budget,
        plan,
        source,
        estimated_cached: prefix.estimated_total(),
    }))
}
