//! Counting prompt tokens, from the best source configured: token-id
//! prompts count exactly; otherwise the served model's tokenizer (from its
//! `.gguf` file or a `tokenizer.json`; prompts over 4 KiB are encoded on a
//! blocking thread), or the upstream's tokenize endpoint in its own
//! dialect ([`crate::upstream_tokenize`]: vLLM's, TGI's, llama.cpp's,
//! llama-cpp-python's), at most one call per request, or an estimate that
//! is labelled as such in the `x-envelope-token-count` header and the
//! metrics.
//!
//! The estimate is an upper bound by default: one token per byte of UTF-8
//! (a byte-level BPE or byte-fallback tokenizer never makes more), so no
//! text, however crafted (`"a a a"`, punctuation, digits, random letters),
//! is under-counted. `bytes_per_token` above 1 trades that bound for less
//! over-reservation on ordinary text.
//!
//! Chat prompts counted locally are the flattened messages' tokens plus
//! [`CHAT_OVERHEAD_PER_MESSAGE`] per message for the template's role
//! markers (an over-estimate for ChatML and Llama-3 templates, which add
//! 4-5); `/tokenize` applies the real template. The caller adds the media
//! parts' configured cost.

use crate::error::GovernError;
use crate::request::{ChatText, ParsedRequest, Prompts};
use crate::upstream_tokenize::{joined_text, ChatOverhead, Dialect};
use envelope_tokenizer::TextTokenizer;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

pub use crate::upstream_tokenize::{CHAT_OVERHEAD_PER_MESSAGE, CHAT_OVERHEAD_REPLY};
/// Tokens a tokenizer may add around a prompt (BOS and the like).
pub const SPECIAL_TOKENS_PER_PROMPT: u64 = 2;

#[derive(Clone)]
pub enum TokenCounter {
    /// The served model's own: from its `.gguf` file or a `tokenizer.json`.
    Tokenizer {
        tokenizer: Arc<TextTokenizer>,
        /// A chat's template tokens (the local count applies no template).
        chat: ChatOverhead,
    },
    Upstream {
        client: crate::client::UpstreamClient,
        /// The endpoint (`{upstream}` + the dialect's path).
        url: String,
        timeout: Duration,
        dialect: Dialect,
        /// A chat's template tokens, where the endpoint applies none.
        chat: ChatOverhead,
    },
    Estimate {
        bytes_per_token: f64,
    },
    /// The estimate with bytes per token learnt from the upstream's own
    /// counts ([`crate::learnt_estimate`]).
    Learnt(Arc<crate::learnt_estimate::LearntEstimate>),
}

/// Where a count came from (a header value and a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountSource {
    TokenIds,
    Tokenizer,
    Upstream,
    Estimate,
    /// The bound estimate, because counting took longer than the count
    /// timeout: an upper bound, so what does not fit by it may still fit.
    EstimateAfterTimeout,
}

impl CountSource {
    pub fn label(self) -> &'static str {
        match self {
            CountSource::TokenIds => "token_ids",
            CountSource::Tokenizer => "tokenizer",
            CountSource::Upstream => "upstream_tokenize",
            CountSource::Estimate => "estimate",
            CountSource::EstimateAfterTimeout => "estimate_after_timeout",
        }
    }
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenCounter::Tokenizer { .. } => write!(f, "Tokenizer"),
            TokenCounter::Upstream { url, dialect, .. } => {
                write!(f, "Upstream({}: {url})", dialect.name())
            }
            TokenCounter::Estimate { bytes_per_token } => {
                write!(f, "Estimate({bytes_per_token} bytes/token)")
            }
            TokenCounter::Learnt(e) => {
                write!(f, "Estimate({} bytes/token, learnt)", e.bytes_per_token())
            }
        }
    }
}

/// The default of `bytes_per_token`: one token per byte, an upper bound.
pub const BOUND_BYTES_PER_TOKEN: f64 = 1.0;

/// bytes / bytes_per_token, rounded up, plus the special tokens a
/// tokenizer may add. With `bytes_per_token` 1 it is never below a
/// byte-level tokenizer's count.
pub fn estimate_tokens(text: &str, bytes_per_token: f64) -> u64 {
    (text.len() as f64 / bytes_per_token.max(0.1)).ceil() as u64 + SPECIAL_TOKENS_PER_PROMPT
}

/// The estimate of a flattened chat prompt (no media).
pub fn estimate_chat(chat: &ChatText, bytes_per_token: f64) -> u64 {
    chat_tokens(chat, |t| estimate_tokens(t, bytes_per_token))
}

fn chat_tokens(chat: &ChatText, mut count: impl FnMut(&str) -> u64) -> u64 {
    chat.messages
        .iter()
        .map(|(_, text)| count(text) + CHAT_OVERHEAD_PER_MESSAGE)
        .sum::<u64>()
        + CHAT_OVERHEAD_REPLY
}

/// The estimate of every group of `req` (the fallback of any counter).
pub fn estimate(req: &ParsedRequest, bytes_per_token: f64) -> Vec<u64> {
    match &req.prompts {
        Prompts::Tokens(t) => t.iter().map(|x| x.len() as u64).collect(),
        Prompts::Texts(v) => v
            .iter()
            .map(|p| estimate_tokens(p, bytes_per_token))
            .collect(),
        Prompts::Messages(c) => vec![estimate_chat(c, bytes_per_token)],
    }
}

/// Prompts up to this many bytes are encoded on the async thread.
pub const INLINE_ENCODE_BYTES: usize = 4096;

/// The bytes of a prompt's text (its messages' text for a chat; 0 for
/// token ids).
pub fn prompt_bytes(p: &Prompts) -> usize {
    match p {
        Prompts::Texts(v) => v.iter().map(String::len).sum(),
        Prompts::Messages(c) => c.messages.iter().map(|(_, t)| t.len()).sum(),
        Prompts::Tokens(_) => 0,
    }
}

fn encode_len(t: &TextTokenizer, text: &str) -> u64 {
    t.encode(text)
        .map(|e| e.len() as u64)
        // A text the tokenizer rejects is counted as one token per byte.
        .unwrap_or(text.len() as u64)
}

impl TokenCounter {
    /// The same counter with `chat` as its chat template's tokens (where
    /// the count applies no template: a local tokenizer, or an endpoint
    /// that takes text only).
    pub fn with_chat_overhead(self, chat: ChatOverhead) -> TokenCounter {
        match self {
            TokenCounter::Tokenizer { tokenizer, .. } => {
                TokenCounter::Tokenizer { tokenizer, chat }
            }
            TokenCounter::Upstream {
                client,
                url,
                timeout,
                dialect,
                ..
            } => TokenCounter::Upstream {
                client,
                url,
                timeout,
                dialect,
                chat,
            },
            other => other,
        }
    }

    /// Counts one text now or with one wait (for measuring a chat
    /// template at start); `None` where the counter cannot.
    pub async fn count_text(&self, text: &str) -> Option<u64> {
        let body = serde_json::to_vec(&json!({ "prompt": text })).ok()?;
        let req = crate::request::parse(crate::request::Endpoint::Completions, &body).ok()?;
        let (counts, _) = self.count(&req).await.ok()?;
        counts.first().copied()
    }

    /// Loads the model's tokenizer from its `.gguf` file (the vocabulary
    /// in its metadata) or a `tokenizer.json`. A file already loaded (and
    /// unchanged: the same length and modification time) gives the same
    /// tokenizer, so model tiers on one model count a prompt once.
    pub fn from_tokenizer_file(path: &std::path::Path) -> Result<TokenCounter, String> {
        type Loaded = std::collections::HashMap<
            (std::path::PathBuf, u64, Option<std::time::SystemTime>),
            std::sync::Weak<TextTokenizer>,
        >;
        static LOADED: std::sync::Mutex<Option<Loaded>> = std::sync::Mutex::new(None);
        let named = |e: String| format!("loading tokenizer {}: {e}", path.display());
        let meta = std::fs::metadata(path).map_err(|e| named(e.to_string()))?;
        let key = (
            std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
            meta.len(),
            meta.modified().ok(),
        );
        let found = LOADED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(Default::default)
            .get(&key)
            .and_then(std::sync::Weak::upgrade);
        let tokenizer = match found {
            Some(t) => t,
            None => {
                let t = Arc::new(TextTokenizer::from_path(path).map_err(|e| named(e.to_string()))?);
                let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
                let loaded = loaded.get_or_insert_with(Default::default);
                loaded.retain(|_, w| w.strong_count() > 0);
                loaded.insert(key, Arc::downgrade(&t));
                t
            }
        };
        Ok(TokenCounter::Tokenizer {
            tokenizer,
            chat: ChatOverhead::default(),
        })
    }

    /// Whether this counter gives `other`'s counts for every prompt: the
    /// same tokenizer and chat overhead, the same tokenize endpoint, or
    /// the same estimate.
    pub fn counts_as(&self, other: &TokenCounter) -> bool {
        match (self, other) {
            (
                TokenCounter::Tokenizer { tokenizer, chat },
                TokenCounter::Tokenizer {
                    tokenizer: t2,
                    chat: c2,
                },
            ) => Arc::ptr_eq(tokenizer, t2) && chat == c2,
            (
                TokenCounter::Upstream {
                    url, dialect, chat, ..
                },
                TokenCounter::Upstream {
                    url: u2,
                    dialect: d2,
                    chat: c2,
                    ..
                },
            ) => url == u2 && dialect == d2 && chat == c2,
            (
                TokenCounter::Estimate { bytes_per_token },
                TokenCounter::Estimate {
                    bytes_per_token: b2,
                },
            ) => bytes_per_token == b2,
            (TokenCounter::Learnt(a), TokenCounter::Learnt(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Prompt tokens per sequence group (without media parts).
    ///
    /// At most one upstream call: a single prompt or a chat goes to
    /// `/tokenize`; a list of several prompts is estimated. An upstream
    /// that answers `/tokenize` with an error (it may not have the
    /// endpoint) falls back to the estimate (one token per byte).
    ///
    /// # Errors
    /// Only the upstream counter fails: 502 when `/tokenize` is unreachable,
    /// 504 when it does not answer within its timeout.
    pub async fn count(&self, req: &ParsedRequest) -> Result<(Vec<u64>, CountSource), GovernError> {
        if let Some(now) = self.count_now(req) {
            return Ok(now);
        }
        match self {
            // Counted now, above.
            TokenCounter::Estimate { bytes_per_token } => {
                Ok((estimate(req, *bytes_per_token), CountSource::Estimate))
            }
            TokenCounter::Learnt(e) => {
                Ok((estimate(req, e.bytes_per_token()), CountSource::Estimate))
            }
            TokenCounter::Tokenizer { tokenizer, chat } => {
                let (t, chat) = (tokenizer.clone(), *chat);
                let prompts = req.prompts.clone();
                let counts = tokio::task::spawn_blocking(move || encode_all(&t, &prompts, &chat))
                    .await
                    .map_err(|e| GovernError::invalid(None, format!("counting failed: {e}")))?;
                Ok((counts, CountSource::Tokenizer))
            }
            TokenCounter::Upstream {
                client,
                url,
                timeout,
                dialect,
                chat,
            } => {
                // What the endpoint is asked, and what to add to its count.
                let (body, added) = match &req.prompts {
                    Prompts::Texts(v) if v.len() == 1 => (dialect.text_body(&v[0]), 0),
                    Prompts::Messages(c) if dialect.takes_chats() => {
                        (json!({ "messages": c.as_messages() }), 0)
                    }
                    Prompts::Messages(c) => (dialect.text_body(&joined_text(c)), chat.of(c)),
                    _ => return Ok((estimate(req, BOUND_BYTES_PER_TOKEN), CountSource::Estimate)),
                };
                // The answer's head and body, both within the timeout.
                let call = async {
                    let resp = client.post_json(url, &body).await?;
                    if !resp.status().is_success() {
                        return Ok(None);
                    }
                    Ok::<_, String>(resp.bytes().await.ok())
                };
                let answer = match tokio::time::timeout(*timeout, call).await {
                    Ok(Ok(a)) => a,
                    Ok(Err(e)) => {
                        tracing::warn!("{e}");
                        return Err(GovernError::UpstreamUnreachable(
                            "counting the prompt's tokens".into(),
                        ));
                    }
                    Err(_) => {
                        tracing::warn!("{url}: no count in {} ms", timeout.as_millis());
                        return Err(GovernError::UpstreamTimeout(
                            "counting the prompt's tokens".into(),
                        ));
                    }
                };
                let count = answer
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .and_then(|v| dialect.count_in(&v));
                Ok(match count {
                    Some(c) => (vec![c + added], CountSource::Upstream),
                    None => (estimate(req, BOUND_BYTES_PER_TOKEN), CountSource::Estimate),
                })
            }
        }
    }
}

impl TokenCounter {
    /// The counts when they take no waiting: token ids, the estimate, and
    /// a short prompt through a local tokenizer (it encodes in
    /// microseconds, less than a hand-off to the blocking pool costs; a
    /// long one would hold the event loop for milliseconds, so it goes
    /// there). `None`: the count needs [`TokenCounter::count`]'s wait,
    /// which callers bound with a timeout and a cap on counts at once.
    pub fn count_now(&self, req: &ParsedRequest) -> Option<(Vec<u64>, CountSource)> {
        if let Prompts::Tokens(t) = &req.prompts {
            return Some((
                t.iter().map(|x| x.len() as u64).collect(),
                CountSource::TokenIds,
            ));
        }
        match self {
            TokenCounter::Estimate { bytes_per_token } => {
                Some((estimate(req, *bytes_per_token), CountSource::Estimate))
            }
            TokenCounter::Learnt(e) => {
                Some((estimate(req, e.bytes_per_token()), CountSource::Estimate))
            }
            TokenCounter::Tokenizer { tokenizer, chat }
                if prompt_bytes(&req.prompts) <= INLINE_ENCODE_BYTES =>
            {
                Some((
                    encode_all(tokenizer, &req.prompts, chat),
                    CountSource::Tokenizer,
                ))
            }
            _ => None,
        }
    }
}

/// Each prompt's (or the chat's) tokens with `t`; a chat's messages
/// joined as an upstream's tokenize endpoint counts them, plus `chat`.
fn encode_all(t: &TextTokenizer, prompts: &Prompts, chat: &ChatOverhead) -> Vec<u64> {
    match prompts {
        Prompts::Texts(v) => v.iter().map(|p| encode_len(t, p)).collect(),
        Prompts::Messages(c) => vec![encode_len(t, &joined_text(c)) + chat.of(c)],
        Prompts::Tokens(v) => v.iter().map(|x| x.len() as u64).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse, Endpoint};

    #[test]
    fn estimate_rounds_up() {
        let s = SPECIAL_TOKENS_PER_PROMPT;
        assert_eq!(estimate_tokens("abcdefg", 3.0), 3 + s);
        assert_eq!(estimate_tokens("abc", 3.0), 1 + s);
        assert_eq!(estimate_tokens("", 3.0), s);
        assert_eq!(estimate_tokens("abcd", 1.0), 4 + s);
        // The default bound: "a a a ..." is about one token per two bytes
        // and punctuation one per byte; neither is under-counted.
        let a = "a ".repeat(500);
        assert!(estimate_tokens(&a, BOUND_BYTES_PER_TOKEN) >= 1000);
        assert!(estimate_tokens("!?.,;:", BOUND_BYTES_PER_TOKEN) >= 6);
    }

    #[tokio::test]
    async fn token_ids_count_exactly_whatever_the_counter() {
        let c = TokenCounter::Estimate {
            bytes_per_token: 3.0,
        };
        let r = parse(Endpoint::Completions, br#"{"prompt":[[1,2,3],[4]]}"#).unwrap();
        assert_eq!(
            c.count(&r).await.unwrap(),
            (vec![3, 1], CountSource::TokenIds)
        );
    }

    #[tokio::test]
    async fn estimate_for_text_and_chat() {
        let c = TokenCounter::Estimate {
            bytes_per_token: 3.0,
        };
        let r = parse(Endpoint::Completions, br#"{"prompt":["abcdef","abcdefg"]}"#).unwrap();
        let sp = SPECIAL_TOKENS_PER_PROMPT;
        assert_eq!(
            c.count(&r).await.unwrap(),
            (vec![2 + sp, 3 + sp], CountSource::Estimate)
        );
        let r = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"system","content":"abc"},{"role":"user","content":[{"type":"text","text":"abcdef"}]}]}"#,
        )
        .unwrap();
        let want = 1 + 2 + 2 * sp + 2 * CHAT_OVERHEAD_PER_MESSAGE + CHAT_OVERHEAD_REPLY;
        assert_eq!(
            c.count(&r).await.unwrap(),
            (vec![want], CountSource::Estimate)
        );
    }

    #[tokio::test]
    async fn tokenizer_json_counts() {
        // A word-level tokenizer built in the test: "a b c" is three tokens.
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"a":0,"b":1,"c":2,"[UNK]":3},"unk_token":"[UNK]"}}"#;
        let dir = std::env::temp_dir().join(format!("envelope-gov-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let c = TokenCounter::from_tokenizer_file(&path).unwrap();
        let r = parse(Endpoint::Completions, br#"{"prompt":"a b c zz"}"#).unwrap();
        assert_eq!(
            c.count(&r).await.unwrap(),
            (vec![4], CountSource::Tokenizer)
        );
        assert!(TokenCounter::from_tokenizer_file(&dir.join("missing.json")).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn unreachable_tokenize_is_a_502() {
        let c = TokenCounter::Upstream {
            client: crate::client::UpstreamClient::new(Duration::from_secs(2)),
            url: "http://127.0.0.1:9/tokenize".into(),
            timeout: Duration::from_secs(2),
            dialect: Dialect::Vllm,
            chat: ChatOverhead::default(),
        };
        let r = parse(Endpoint::Completions, br#"{"prompt":"x"}"#).unwrap();
        let e = c.count(&r).await.unwrap_err();
        assert_eq!(e.status().as_u16(), 502);
    }

    #[test]
    fn only_counts_that_wait_are_left_to_count() {
        let text = parse(Endpoint::Completions, br#"{"prompt":"hello there"}"#).unwrap();
        let ids = parse(Endpoint::Completions, br#"{"prompt":[1,2,3]}"#).unwrap();
        let estimate = TokenCounter::Estimate {
            bytes_per_token: 3.0,
        };
        assert_eq!(
            estimate.count_now(&text).map(|c| c.1),
            Some(CountSource::Estimate)
        );
        let upstream = TokenCounter::Upstream {
            client: crate::client::UpstreamClient::new(Duration::from_secs(2)),
            url: "http://127.0.0.1:9/tokenize".into(),
            timeout: Duration::from_secs(2),
            dialect: Dialect::Vllm,
            chat: ChatOverhead::default(),
        };
        // A /tokenize call waits (under the caller's timeout and cap)...
        assert!(upstream.count_now(&text).is_none());
        // ...token ids never need one.
        assert_eq!(
            upstream.count_now(&ids),
            Some((vec![3], CountSource::TokenIds))
        );
    }
}
