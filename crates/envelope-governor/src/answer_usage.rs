//! The `usage` numbers an answer ends with, found by a byte search of its
//! end: the one reader of usage, for the relay (prompt and completion
//! tokens, to settle a request with) and for the model tiers' router
//! (with the cached prompt tokens, for its cost book). The bytes are
//! searched as they are, not parsed as JSON or made text: the relay reads
//! every answer's tail this way.

use crate::price::Usage;
use memchr::memmem::Finder;

type Key = std::sync::LazyLock<Finder<'static>>;

/// The `usage` keys. The last of each counts, found by the forward search
/// (vectorised), not the reverse one (which is not, and cost several
/// times more on a short answer). A key inside a string of the answer's
/// text is escaped (`\"prompt_tokens\"`), so it is not found.
static PROMPT_TOKENS: Key = Key::new(|| Finder::new(b"\"prompt_tokens\""));
static COMPLETION_TOKENS: Key = Key::new(|| Finder::new(b"\"completion_tokens\""));
/// In `usage.prompt_tokens_details`.
static CACHED_TOKENS: Key = Key::new(|| Finder::new(b"\"cached_tokens\""));

/// The number after the last `key` in `hay` (spaces, colons and quotes
/// between them skipped).
fn find_number(hay: &[u8], key: &Finder<'_>) -> Option<u64> {
    let i = key.find_iter(hay).last()? + key.needle().len();
    let rest = &hay[i..];
    let start = rest.iter().position(|b| !matches!(b, b' ' | b':' | b'"'))?;
    let rest = &rest[start..];
    let len = rest
        .iter()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(rest.len());
    std::str::from_utf8(&rest[..len]).ok()?.parse().ok()
}

/// The prompt and completion tokens at the end of `answer` (a JSON body
/// or an SSE stream), each where it is found.
pub fn prompt_and_completion(answer: &[u8]) -> (Option<u64>, Option<u64>) {
    (
        find_number(answer, &PROMPT_TOKENS),
        find_number(answer, &COMPLETION_TOKENS),
    )
}

/// The prompt, completion and cached prompt tokens at the end of
/// `answer`, each where it is found (a server that does not report its
/// prefix cache gives no `cached_tokens`: `None`, not 0).
pub fn numbers(answer: &[u8]) -> (Option<u64>, Option<u64>, Option<u64>) {
    let (p, c) = prompt_and_completion(answer);
    (p, c, find_number(answer, &CACHED_TOKENS))
}

/// The whole `usage` of `answer`: prompt and completion tokens (both, or
/// none), and the cached prompt tokens (0 when not given).
pub fn usage(answer: &[u8]) -> Option<Usage> {
    let (Some(prompt), Some(completion)) = prompt_and_completion(answer) else {
        return None;
    };
    Some(Usage {
        prompt,
        completion,
        cached: find_number(answer, &CACHED_TOKENS).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_numbers_are_found_in_the_tail() {
        let t =
            br#"data: {"usage":{"prompt_tokens":12,"completion_tokens": 30,"total_tokens":42}}"#;
        assert_eq!(find_number(t, &PROMPT_TOKENS), Some(12));
        assert_eq!(find_number(t, &COMPLETION_TOKENS), Some(30));
        let nope = Finder::new(b"\"nope\"");
        assert_eq!(find_number(t, &nope), None);
        // The last one counts (a stream's final usage); no digits, none;
        // bytes that are not UTF-8 around it do not matter.
        let t = b"\"prompt_tokens\":1 \xff \"prompt_tokens\" : \"7\"}";
        assert_eq!(find_number(t, &PROMPT_TOKENS), Some(7));
        assert_eq!(find_number(b"\"prompt_tokens\": x", &PROMPT_TOKENS), None);
        assert_eq!(find_number(b"\"prompt_tokens\"", &PROMPT_TOKENS), None);
        let big = b"\"completion_tokens\":99999999999999999999999";
        assert_eq!(find_number(big, &COMPLETION_TOKENS), None);
    }

    #[test]
    fn the_whole_usage_needs_both_counts_and_reads_cached_tokens() {
        let body = br#"{"choices":[{"text":"say \"prompt_tokens\": 99"}],
            "usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,
                     "prompt_tokens_details":{"cached_tokens":4}}}"#;
        let u = usage(body).unwrap();
        assert_eq!((u.prompt, u.completion, u.cached), (7, 3, 4));
        // The key in the answer's text is escaped: not taken for usage.
        let text_only = br#"{"choices":[{"text":"say \"prompt_tokens\": 99"}]}"#;
        assert_eq!(prompt_and_completion(text_only), (None, None));
        let no_cache = br#"{"usage":{"prompt_tokens":7,"completion_tokens":3}}"#;
        assert_eq!(usage(no_cache).unwrap().cached, 0);
        assert_eq!(usage(br#"{"usage":{"prompt_tokens":7}}"#), None);
    }
}
