//! OpenAI request types, parsed and then validated into engine parameters
//! (TGI's `GenerateRequest` -> `ValidGenerateRequest` pattern): every
//! message names the field at fault.

use crate::error::ApiError;
use envelope_engine::{ChatMessage, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both endpoints.
#[derive(Debug, Deserialize, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<StringOrList>,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub n: Option<i64>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<RawMessage>,
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct RawMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<RawMessage>>,
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
}

fn yes() -> bool {
    true
}

/// Parses a JSON body into `T`, mapping syntax and type errors to 400s.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::invalid(None, "the request body is not valid UTF-8"))?;
    serde_json::from_str(text).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "invalid request"
        };
        ApiError::invalid(None, format!("{what}: {e}"))
    })
}

pub fn messages(raw: &[RawMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    if raw.is_empty() {
        return Err(ApiError::invalid(
            Some("messages".into()),
            "messages must not be empty",
        ));
    }
    raw.iter()
        .enumerate()
        .map(|(i, m)| {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer" | "tool"
            ) {
                return Err(ApiError::invalid(
                    Some(format!("messages[{i}].role")),
                    format!("unknown role `{}`", m.role),
                ));
            }
            let content = match &m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => s.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    Some(format!("messages[{i}].content[{j}]")),
                                    "only text content parts are supported",
                                ))
                            }
                        }
                    }
                    s
                }
                Some(_) => {
                    return Err(ApiError::invalid(
                        Some(format!("messages[{i}].content")),
                        "content must be a string or a list of text parts",
                    ))
                }
            };
            let role = if m.role == "developer" {
                "system".to_string()
            } else {
                m.role.clone()
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

/// Sampling parameters from the request; `max_tokens` falls back to `default_max`.
pub fn sampling(
    c: &Common,
    max_tokens: Option<i64>,
    default_max: usize,
) -> Result<SamplingParams, ApiError> {
    let bad = |p: &str, m: String| Err(ApiError::invalid(Some(p.to_string()), m));
    if let Some(n) = c.n {
        if n != 1 {
            return bad("n", format!("only n=1 is supported, got {n}"));
        }
    }
    if matches!(c.logprobs, Some(Value::Bool(true)) | Some(Value::Number(_)))
        || c.top_logprobs.as_ref().is_some_and(|v| !v.is_null())
    {
        return bad("logprobs", "logprobs are not supported".into());
    }
    let temperature = c.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || temperature < 0.0 {
        return bad("temperature", format!("must be >= 0, got {temperature}"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !top_p.is_finite() || top_p <= 0.0 || top_p > 1.0 {
        return bad("top_p", format!("must be in (0, 1], got {top_p}"));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => return bad("top_k", format!("must be -1, 0 or positive, got {k}")),
    };
    let max_tokens = match max_tokens {
        None => default_max,
        Some(m) if m >= 1 => m as usize,
        Some(m) => return bad("max_tokens", format!("must be at least 1, got {m}")),
    };
    let stop = match &c.stop {
        None => vec![],
        Some(StringOrList::One(s)) => vec![s.clone()],
        Some(StringOrList::Many(v)) => v.clone(),
    };
    if stop.len() > 16 {
        return bad(
            "stop",
            format!("at most 16 stop strings, got {}", stop.len()),
        );
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k,
        seed: c.seed,
        max_tokens,
        stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
        stop_token_ids: c.stop_token_ids.clone(),
        ignore_eos: c.ignore_eos,
    })
}
