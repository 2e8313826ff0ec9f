//! The reserved stage: with budgets over time, a planned request's tokens,
//! cost and count are reserved before it queues (a request over budget
//! does not wait for a slot first). The hold rides beside the permit to
//! its [`Settlement`](super::Settlement); dropped before the request is
//! sent, it gives everything back.

use super::GovernedUpstream;
use crate::budget::{self, Amounts, Budgets, Hold};
use crate::error::GovernError;
use crate::policy::Plan;

/// Reserves what `plan` may use against the budgets of `tenant` and
/// `feature`; `Ok(None)` where no budget applies.
///
/// # Errors
/// 400 when the request is larger than a budget could ever hold, 429
/// over budget, 503 when the store is away and a budget fails closed.
pub(crate) async fn reserve(
    s: &GovernedUpstream,
    budgets: &Budgets,
    tenant: &str,
    feature: Option<&str>,
    plan: &Plan,
) -> Result<Option<Hold>, GovernError> {
    let a = Amounts::of_request(
        budgets,
        plan.prompt_tokens,
        plan.max_tokens,
        plan.demand.seqs,
    );
    let m = &s.gov.metrics;
    // Boxed, as counting's wait is: only requests with budgets carry its
    // future.
    Box::pin(budget::reserve(
        &s.budget_store,
        budgets,
        m,
        tenant,
        feature,
        a,
    ))
    .await
}
