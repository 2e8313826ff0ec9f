//! Counting prompt tokens, from the best source configured: token-id
//! prompts count exactly; otherwise the served model's `tokenizer.json`
//! (the `tokenizers` crate), or the upstream's `POST /tokenize` (vLLM's
//! shape, which `envelope serve` also has: `{"prompt"}` or `{"messages"}` ->
//! `{"count"}`), or a conservative estimate (bytes / `bytes_per_token`,
//! rounded up) that is labelled as such in the `x-envelope-token-count`
//! header and the metrics.
//!
//! Chat prompts with a local tokenizer are counted as the content tokens
//! plus [`CHAT_OVERHEAD_PER_MESSAGE`] per message for the template's role
//! markers (an over-estimate for ChatML and Llama-3 templates, which add
//! 4-5); `/tokenize` applies the real template.

use crate::error::GovernError;
use crate::request::{message_text, ParsedRequest, Prompts};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

pub const CHAT_OVERHEAD_PER_MESSAGE: u64 = 8;
/// Tokens for the assistant turn's opening that the template appends.
pub const CHAT_OVERHEAD_REPLY: u64 = 8;

#[derive(Clone)]
pub enum TokenCounter {
    Tokenizer(Arc<tokenizers::Tokenizer>),
    Upstream {
        client: reqwest::Client,
        url: String,
        timeout: Duration,
    },
    Estimate {
        bytes_per_token: f64,
    },
}

/// Where a count came from (a header value and a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CountSource {
    TokenIds,
    Tokenizer,
    Upstream,
    Estimate,
}

impl CountSource {
    pub fn label(self) -> &'static str {
        match self {
            CountSource::TokenIds => "token_ids",
            CountSource::Tokenizer => "tokenizer",
            CountSource::Upstream => "upstream_tokenize",
            CountSource::Estimate => "estimate",
        }
    }
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenCounter::Tokenizer(_) => write!(f, "Tokenizer"),
            TokenCounter::Upstream { url, .. } => write!(f, "Upstream({url})"),
            TokenCounter::Estimate { bytes_per_token } => {
                write!(f, "Estimate({bytes_per_token} bytes/token)")
            }
        }
    }
}

/// bytes / bytes_per_token, rounded up, at least 1.
pub fn estimate_tokens(text: &str, bytes_per_token: f64) -> u64 {
    ((text.len() as f64 / bytes_per_token.max(0.1)).ceil() as u64).max(1)
}

impl TokenCounter {
    /// Loads a `tokenizer.json`.
    pub fn from_tokenizer_file(path: &std::path::Path) -> Result<TokenCounter, String> {
        tokenizers::Tokenizer::from_file(path)
            .map(|t| TokenCounter::Tokenizer(Arc::new(t)))
            .map_err(|e| format!("loading tokenizer {}: {e}", path.display()))
    }

    fn local(&self, text: &str) -> u64 {
        match self {
            TokenCounter::Tokenizer(t) => t
                .encode(text, false)
                .map(|e| e.len() as u64)
                // A text the tokenizer rejects is counted as one token per byte.
                .unwrap_or(text.len() as u64),
            TokenCounter::Estimate { bytes_per_token } => estimate_tokens(text, *bytes_per_token),
            TokenCounter::Upstream { .. } => estimate_tokens(text, 1.0),
        }
    }

    fn local_source(&self) -> CountSource {
        match self {
            TokenCounter::Tokenizer(_) => CountSource::Tokenizer,
            _ => CountSource::Estimate,
        }
    }

    fn local_messages(&self, msgs: &[Value]) -> u64 {
        msgs.iter()
            .map(|m| self.local(&message_text(m)) + CHAT_OVERHEAD_PER_MESSAGE)
            .sum::<u64>()
            + CHAT_OVERHEAD_REPLY
    }

    /// Prompt tokens per sequence group.
    ///
    /// # Errors
    /// Only the upstream counter fails: 502 when `/tokenize` is unreachable.
    /// An upstream that answers `/tokenize` with an error (it may not have
    /// the endpoint) falls back to the estimate with one token per byte.
    pub async fn count(&self, req: &ParsedRequest) -> Result<(Vec<u64>, CountSource), GovernError> {
        if let Prompts::Tokens(t) = &req.prompts {
            return Ok((
                t.iter().map(|x| x.len() as u64).collect(),
                CountSource::TokenIds,
            ));
        }
        match self {
            TokenCounter::Upstream {
                client,
                url,
                timeout,
            } => {
                let bodies: Vec<Value> = match &req.prompts {
                    Prompts::Texts(v) => v.iter().map(|p| json!({ "prompt": p })).collect(),
                    Prompts::Messages(m) => vec![json!({ "messages": m })],
                    Prompts::Tokens(_) => unreachable!("handled above"),
                };
                let mut counts = Vec::with_capacity(bodies.len());
                let mut source = CountSource::Upstream;
                for b in bodies {
                    let resp = client
                        .post(url)
                        .json(&b)
                        .timeout(*timeout)
                        .send()
                        .await
                        .map_err(|e| {
                            if e.is_timeout() {
                                GovernError::UpstreamTimeout(format!("{url}: {e}"))
                            } else {
                                GovernError::UpstreamUnreachable(format!("{url}: {e}"))
                            }
                        })?;
                    let count = if resp.status().is_success() {
                        resp.json::<Value>()
                            .await
                            .ok()
                            .and_then(|v| v.get("count").and_then(Value::as_u64))
                    } else {
                        None
                    };
                    match count {
                        Some(c) => counts.push(c),
                        None => {
                            source = CountSource::Estimate;
                            counts.push(match &req.prompts {
                                Prompts::Messages(m) => self.local_messages(m),
                                _ => estimate_tokens(b["prompt"].as_str().unwrap_or(""), 1.0),
                            });
                        }
                    }
                }
                Ok((counts, source))
            }
            _ => {
                let counts = match &req.prompts {
                    Prompts::Texts(v) => v.iter().map(|p| self.local(p)).collect(),
                    Prompts::Messages(m) => vec![self.local_messages(m)],
                    Prompts::Tokens(_) => unreachable!("handled above"),
                };
                Ok((counts, self.local_source()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse, Endpoint};

    #[test]
    fn estimate_rounds_up() {
        assert_eq!(estimate_tokens("abcdefg", 3.0), 3);
        assert_eq!(estimate_tokens("abc", 3.0), 1);
        assert_eq!(estimate_tokens("", 3.0), 1);
        assert_eq!(estimate_tokens("abcd", 1.0), 4);
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
        assert_eq!(
            c.count(&r).await.unwrap(),
            (vec![2, 3], CountSource::Estimate)
        );
        let r = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"system","content":"abc"},{"role":"user","content":[{"type":"text","text":"abcdef"}]}]}"#,
        )
        .unwrap();
        let want = 1 + 2 + 2 * CHAT_OVERHEAD_PER_MESSAGE + CHAT_OVERHEAD_REPLY;
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
            client: reqwest::Client::new(),
            url: "http://127.0.0.1:9/tokenize".into(),
            timeout: Duration::from_secs(2),
        };
        let r = parse(Endpoint::Completions, br#"{"prompt":"x"}"#).unwrap();
        let e = c.count(&r).await.unwrap_err();
        assert_eq!(e.status().as_u16(), 502);
    }
}
