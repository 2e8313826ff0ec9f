//! The headers of a governed exchange: what is forwarded to the upstream
//! (not the hop-by-hop ones, nor the governor's own), and what the
//! governor adds to an answer. The names it adds to every answer are
//! constants: parsing a name from text on every request was about 2% of
//! the governor's instructions a request.

use super::{Placed, DEADLINE_HEADER};
use crate::identity::CLASS_HEADER;
use axum::http::{HeaderMap, HeaderName, HeaderValue};

pub(crate) const HOP_BY_HOP: &[&str] = &[
    "host",
    "content-length",
    "connection",
    "transfer-encoding",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
];

pub(crate) fn forward_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(h.len());
    for (k, v) in h {
        let name = k.as_str();
        if HOP_BY_HOP.contains(&name) || name == DEADLINE_HEADER || name.starts_with("x-envelope-")
        {
            continue;
        }
        out.append(k.clone(), v.clone());
    }
    out
}

/// Headers added to an answer.
pub(crate) type Extra = Vec<(HeaderName, HeaderValue)>;

/// `(name, text)` pairs as [`Extra`] (the rarer headers: budgets, tiers);
/// a text that is not a header value is left out.
pub(crate) fn named(
    pairs: impl IntoIterator<Item = (&'static str, String)>,
) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
    pairs.into_iter().filter_map(|(k, v)| {
        let v = HeaderValue::from_str(&v).ok()?;
        Some((HeaderName::from_static(k), v))
    })
}

const MAX_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-envelope-max-tokens");
const DECISION_HEADER: HeaderName = HeaderName::from_static("x-envelope-max-tokens-decision");
const PROMPT_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-envelope-prompt-tokens");
const TOKEN_COUNT_HEADER: HeaderName = HeaderName::from_static("x-envelope-token-count");
const QUEUE_MS_HEADER: HeaderName = HeaderName::from_static("x-envelope-queue-ms");
pub(super) const TENANT_HEADER: HeaderName = HeaderName::from_static("x-envelope-tenant");
pub(super) const CLASS: HeaderName = HeaderName::from_static(CLASS_HEADER);

/// The headers that say what the governor did with a placed request.
pub(crate) fn placed_headers(placed: &Placed) -> Extra {
    let mut out = vec![
        (MAX_TOKENS_HEADER, HeaderValue::from(placed.plan.max_tokens)),
        (
            DECISION_HEADER,
            HeaderValue::from_static(placed.plan.decision.label()),
        ),
        (
            PROMPT_TOKENS_HEADER,
            HeaderValue::from(placed.plan.prompt_tokens),
        ),
        (
            TOKEN_COUNT_HEADER,
            HeaderValue::from_static(placed.source.label()),
        ),
        (
            QUEUE_MS_HEADER,
            HeaderValue::from(placed.permit.queued_for.as_millis() as u64),
        ),
    ];
    if let Some(h) = &placed.permit.budget {
        out.extend(named(h.headers().iter().cloned()));
    }
    out
}
