//! The headers of a governed exchange: what is forwarded to the upstream
//! (not the hop-by-hop ones, nor the governor's own), and what the
//! governor adds to an answer. The names it adds to every answer are
//! constants, not parsed from text on every request
//! (docs/measurements/2026-12-06-governor-code-figures.md).

use super::{Placed, DEADLINE_HEADER};
use axum::http::{HeaderMap, HeaderName, HeaderValue};

pub const HOP_BY_HOP: &[&str] = &[
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

pub fn forward_headers(h: &HeaderMap) -> HeaderMap {
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
pub type Extra = Vec<(HeaderName, HeaderValue)>;

/// `(name, text)` pairs as [`Extra`] (the rarer headers: budgets, tiers);
/// a text that is not a header value is left out.
pub fn named(
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
const CACHED_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-envelope-prompt-cached-tokens");
const TOKEN_COUNT_HEADER: HeaderName = HeaderName::from_static("x-envelope-token-count");
const QUEUE_MS_HEADER: HeaderName = HeaderName::from_static("x-envelope-queue-ms");

/// The headers that say what the governor did with a placed request
/// (budget headers after them, when the request has budgets).
pub fn placed_headers(placed: &Placed) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
    let budget = placed
        .budget
        .as_ref()
        .map(|h| named(h.headers().iter().cloned()).collect::<Vec<_>>())
        .unwrap_or_default();
    [
        (MAX_TOKENS_HEADER, number(placed.plan.max_tokens)),
        (
            DECISION_HEADER,
            HeaderValue::from_static(placed.plan.decision.label()),
        ),
        (PROMPT_TOKENS_HEADER, number(placed.plan.prompt_tokens)),
        (CACHED_TOKENS_HEADER, number(placed.plan.cached_tokens)),
        (
            TOKEN_COUNT_HEADER,
            HeaderValue::from_static(placed.source.label()),
        ),
        (
            QUEUE_MS_HEADER,
            number(placed.permit.queued_for.as_millis() as u64),
        ),
    ]
    .into_iter()
    .chain(budget)
}

/// Numbers below this are answered from one text made once.
const SMALL: usize = 10_000;
/// Each small number's place in that text: its digits, then spaces.
const STRIDE: usize = 4;

/// The small numbers' text, made once.
static DIGITS: std::sync::LazyLock<&'static str> = std::sync::LazyLock::new(|| {
    use std::fmt::Write;
    let mut s = String::with_capacity(SMALL * STRIDE);
    for i in 0..SMALL {
        let _ = write!(s, "{i:<STRIDE$}");
    }
    Box::leak(s.into_boxed_str())
});

/// Makes the small numbers' text now (at start), not in the first answer.
pub fn warm() {
    std::sync::LazyLock::force(&DIGITS);
}

/// A number as a header value. Most of an answer's numbers (its output
/// limit, prompt tokens, milliseconds queued) are small: those are slices
/// of one text made once, which cost no allocation (a value made from a
/// number allocates and formats).
pub fn number(n: u64) -> HeaderValue {
    match usize::try_from(n) {
        Ok(i) if i < SMALL => {
            let len = i.checked_ilog10().unwrap_or(0) as usize + 1;
            HeaderValue::from_static(&DIGITS[i * STRIDE..i * STRIDE + len])
        }
        _ => HeaderValue::from(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_number_reads_the_same_from_the_table_or_made() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            100,
            999,
            1000,
            9999,
            10_000,
            123_456,
            u64::MAX,
        ] {
            assert_eq!(number(n), HeaderValue::from(n), "{n}");
        }
        for n in 0..SMALL as u64 {
            assert_eq!(number(n).to_str().unwrap(), n.to_string());
        }
    }

    #[test]
    fn hop_by_hop_and_governor_headers_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close"));
        h.insert("x-envelope-tenant", HeaderValue::from_static("a"));
        h.insert(DEADLINE_HEADER, HeaderValue::from_static("5"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        let f = forward_headers(&h);
        assert_eq!(f.len(), 1);
        assert!(f.contains_key("authorization"));
    }
}
