//! When a request counts as served. A request succeeds only when it is
//! complete: the output asked for arrived and the server said why it ended.
//! A short, cut or empty answer is an error with a reason (the word before
//! the first `:` of `RequestRecord::error`, a column of `requests.csv`),
//! counted by `max_error_rate` like any other failure; a server that ends
//! streams early under load is then measured as failing, not as fast.
//!
//! Before an http or launch target is swept, [`crate::check`] asks it once
//! whether it honours what these judgements rely on.

use crate::record::RequestRecord;
use std::collections::BTreeMap;

/// Reasons a request failed; the first word of its error.
pub mod reason {
    /// Fewer output tokens than asked (with `ignore_eos`), or cut while
    /// the server said `length`.
    pub const SHORT_OUTPUT: &str = "short_output";
    /// A finish reason, but no output at all.
    pub const EMPTY_OUTPUT: &str = "empty_output";
    /// The stream ended (`[DONE]`) without a finish reason in any chunk.
    pub const NO_FINISH_REASON: &str = "no_finish_reason";
    /// The connection or stream broke, or ended without `[DONE]`.
    pub const STREAM_CUT: &str = "stream_cut";
    /// An error event inside a 200 stream.
    pub const SERVER_ERROR: &str = "server_error";
    /// A data line that is not JSON.
    pub const BAD_SSE: &str = "bad_sse";
    /// The request could not be sent (refused, timed out).
    pub const REQUEST_FAILED: &str = "request_failed";
    /// The engine refused the request or stopped.
    pub const ENGINE_ERROR: &str = "engine_error";
    /// A 429 with Retry-After: the target shed the request (a governor's
    /// answer to load over its envelope). Counted apart from failures.
    pub const REFUSED: &str = "refused";
}

/// `reason: detail`, the form of every request error.
pub fn error(reason: &str, detail: impl std::fmt::Display) -> String {
    format!("{reason}: {detail}")
}

/// The reason of an error: `http_503`, `short_output`, ...
pub fn reason_of(error: &str) -> &str {
    error.split(':').next().unwrap_or(error).trim()
}

/// Whether a request that ended without a transport error is complete.
/// `asked` is the output length requested; `exact` is whether the server
/// honours `ignore_eos` (then anything short of `asked` is an error; else an
/// answer that stopped by itself, `finish_reason: stop`, is complete).
/// Returns the error to record, if any.
pub fn judge(asked: u32, rec: &RequestRecord, exact: bool) -> Option<String> {
    if rec.error.is_some() {
        return None;
    }
    let got = rec.output_tokens;
    let Some(finish) = rec.finish_reason.as_deref() else {
        return Some(error(
            reason::NO_FINISH_REASON,
            format!("{got} of {asked} tokens and no finish_reason"),
        ));
    };
    if got == 0 {
        return Some(error(
            reason::EMPTY_OUTPUT,
            format!("no tokens of {asked} (finish_reason {finish})"),
        ));
    }
    if got < asked && (exact || finish != "stop") {
        return Some(error(
            reason::SHORT_OUTPUT,
            format!("{got} of {asked} tokens (finish_reason {finish})"),
        ));
    }
    None
}

/// Failed requests counted by reason (refusals are not failures).
pub fn reasons(records: &[RequestRecord]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for e in records
        .iter()
        .filter(|r| r.retry_after_s.is_none())
        .filter_map(|r| r.error.as_deref())
    {
        *out.entry(reason_of(e).to_string()).or_insert(0) += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(out: u32, finish: Option<&str>) -> RequestRecord {
        RequestRecord {
            output_tokens: out,
            finish_reason: finish.map(str::to_string),
            ..Default::default()
        }
    }

    #[test]
    fn complete_answers_pass() {
        assert_eq!(judge(32, &rec(32, Some("length")), true), None);
        // A server that ignores ignore_eos: stopping by itself is complete.
        assert_eq!(judge(32, &rec(5, Some("stop")), false), None);
    }

    #[test]
    fn short_cut_and_empty_answers_fail_with_a_reason() {
        let e = judge(32, &rec(1, Some("stop")), true).unwrap();
        assert_eq!(reason_of(&e), "short_output", "{e}");
        assert!(e.contains("1 of 32"), "{e}");
        // Cut with `length` short of the ask is short even without ignore_eos.
        let e = judge(32, &rec(3, Some("length")), false).unwrap();
        assert_eq!(reason_of(&e), "short_output");
        let e = judge(32, &rec(32, None), true).unwrap();
        assert_eq!(reason_of(&e), "no_finish_reason");
        let e = judge(32, &rec(0, Some("stop")), false).unwrap();
        assert_eq!(reason_of(&e), "empty_output");
    }

    #[test]
    fn a_transport_error_is_kept() {
        let mut r = rec(0, None);
        r.error = Some(error("http_503", "busy"));
        assert_eq!(judge(32, &r, true), None);
        assert_eq!(reasons(&[r.clone(), r]).get("http_503"), Some(&2));
    }
}
