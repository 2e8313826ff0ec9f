//! What `--record` needs from a request's path: its draft when it is
//! counted, and how it finished when its body ends
//! ([`crate::recorder`] writes them).

use super::{Incoming, StreamEnd};
use crate::identity::Identity;
use crate::recorder::{Draft, Finished};

/// The draft of `inc`, counted at `input_tokens`, from `who`: its session
/// and feature as read with the request.
pub fn draft(inc: &Incoming, input_tokens: u64, who: &Identity) -> Draft {
    Draft {
        arrived: inc.arrived,
        arrived_unix_s: Draft::unix_s_of(inc.arrived),
        endpoint: inc.parsed.endpoint,
        body: inc.parsed.raw().clone(),
        input_tokens,
        session: inc.conversation.clone(),
        class: who.class.label(),
        tenant: who.tenant.clone(),
        feature: inc.feature.clone(),
    }
}

/// `draft` finished as a relayed body ended (`end`), with `status`.
pub fn ended(draft: Draft, status: u16, end: &StreamEnd) -> Finished {
    let output = end
        .completion_tokens
        .unwrap_or_else(|| end.events.saturating_sub(u64::from(end.whole)));
    Finished {
        output_tokens: output,
        status,
        ttft_ms: end
            .first_chunk
            .map(|t| t.saturating_duration_since(draft.arrived).as_secs_f64() * 1e3),
        e2e_ms: draft.arrived.elapsed().as_secs_f64() * 1e3,
        tiers: None,
        draft,
    }
}
