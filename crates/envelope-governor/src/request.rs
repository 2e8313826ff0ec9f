//! Parse, then validate (TGI's `GenerateRequest` -> `ValidGenerateRequest`):
//! the fields the governor needs from an OpenAI request body, each checked
//! and named in the error. Fields the governor does not read (including
//! unknown ones) are passed through untouched: the upstream owns them.
//!
//! Nothing a server turns into work escapes the count: every output-length
//! field the common servers honour ([`OUTPUT_FIELDS`]) is read (the largest
//! counts) and all of them are rewritten to the one limit applied, with
//! `min_tokens` kept under it; sequences are the larger of `n` and `best_of`;
//! a chat prompt is its messages' text, every other field of a message
//! (`tool_calls`, `name`, ...) and the request's `tools` as JSON text, and a
//! configured cost per image or audio part ([`ChatText`]).

use crate::error::GovernError;
use fields::Fields;
use serde_json::{Map, Value};

mod fields;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// Every governed endpoint: the routes of both front doors (one
    /// upstream, model tiers) are made from this list.
    pub const ALL: [Endpoint; 2] = [Endpoint::Completions, Endpoint::Chat];

    /// The governed endpoint served at `path`, if any.
    pub fn at(path: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|e| e.path() == path)
    }

    /// Where it is served (and forwarded to).
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::Chat => "messages",
        }
    }
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

/// The prompt(s): one per sequence group (a completions batch has several).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompts {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
    /// A chat request's messages as the text that becomes prompt tokens.
    Messages(ChatText),
}

/// Media parts of a chat request, charged a configured cost each.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Media {
    pub images: u64,
    pub audio: u64,
}

/// A chat request flattened to (role, text) pairs: each message's text
/// parts, then every other field of it (`tool_calls`, `name`,
/// `tool_call_id`, ...) as JSON; the request's `tools` / `functions` /
/// `tool_choice` as JSON in a leading system message; parts that are
/// neither text nor media as JSON. Media parts are counted, not texted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatText {
    pub messages: Vec<(String, String)>,
    pub media: Media,
}

impl ChatText {
    /// The messages as `/tokenize` takes them.
    pub fn as_messages(&self) -> Value {
        Value::Array(
            self.messages
                .iter()
                .map(|(role, text)| serde_json::json!({"role": role, "content": text}))
                .collect(),
        )
    }
}

/// Request fields that add prompt tokens through the chat template.
const TOOL_FIELDS: &[&str] = &["tools", "functions", "tool_choice"];

fn flatten_chat(tool_fields: &[Option<&Value>], msgs: &[Value]) -> ChatText {
    let mut out = ChatText::default();
    let tools: Vec<String> = tool_fields
        .iter()
        .filter_map(|v| v.filter(|v| !v.is_null() && !v.is_string()))
        .map(Value::to_string)
        .collect();
    if !tools.is_empty() {
        out.messages.push(("system".into(), tools.join("\n")));
    }
    for m in msgs {
        let Some(obj) = m.as_object() else { continue };
        let role = obj.get("role").and_then(Value::as_str).unwrap_or("user");
        let mut text = String::new();
        match obj.get("content") {
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                    match (kind, p.get("text").and_then(Value::as_str)) {
                        (_, Some(t)) => text.push_str(t),
                        ("image_url" | "image" | "input_image", _) => out.media.images += 1,
                        ("input_audio" | "audio" | "audio_url", _) => out.media.audio += 1,
                        _ => text.push_str(&p.to_string()),
                    }
                }
            }
            _ => {}
        }
        for (k, v) in obj {
            if k != "role" && k != "content" && !v.is_null() {
                text.push(' ');
                text.push_str(k);
                text.push_str(&v.to_string());
            }
        }
        out.messages.push((role.to_string(), text));
    }
    out
}

impl Prompts {
    pub fn groups(&self) -> usize {
        match self {
            Prompts::Texts(v) => v.len(),
            Prompts::Tokens(v) => v.len(),
            Prompts::Messages(_) => 1,
        }
    }

    /// Each group's prompt as the bytes it is hashed by, in order: a text
    /// as it is, token ids little-endian, a chat's messages as role, 0,
    /// text, 0 each. Equal leading bytes are an equal prompt prefix.
    pub fn group_bytes(&self) -> Vec<std::borrow::Cow<'_, [u8]>> {
        use std::borrow::Cow;
        match self {
            Prompts::Texts(v) => v.iter().map(|t| Cow::Borrowed(t.as_bytes())).collect(),
            Prompts::Tokens(v) => v
                .iter()
                .map(|ids| Cow::Owned(ids.iter().flat_map(|t| t.to_le_bytes()).collect()))
                .collect(),
            Prompts::Messages(m) => {
                let mut b = vec![];
                for (role, content) in &m.messages {
                    b.extend_from_slice(role.as_bytes());
                    b.push(0);
                    b.extend_from_slice(content.as_bytes());
                    b.push(0);
                }
                vec![Cow::Owned(b)]
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    /// The body as read (a JSON object).
    raw: bytes::Bytes,
    /// The body as a JSON map, made the first time it is asked for (tiers
    /// and rewrites need it; the common path reads its fields typed).
    body: std::sync::OnceLock<Map<String, Value>>,
    pub prompts: Prompts,
    /// The client's limit, if any: the largest of the output-length fields
    /// it set (None when none is set, or llama.cpp's `n_predict` is -1).
    pub max_tokens: Option<u64>,
    /// The field the limit is written to when the client set none.
    pub max_tokens_field: &'static str,
    /// The output-length fields the client set, with their values (each
    /// rewritten to the limit when over it).
    pub output_fields: Vec<(&'static str, i64)>,
    /// vLLM's `min_tokens` (kept at most the limit).
    pub min_tokens: Option<u64>,
    /// Sequences generated: the larger of `n` and `best_of`.
    pub n: u64,
    pub stream: bool,
}

/// Upper bound on `n` and `best_of` (OpenAI's own is 128).
pub const MAX_N: u64 = 128;

/// Output-length fields: OpenAI's two, llama.cpp's `n_predict`, TGI's
/// `max_new_tokens`. A server may honour any of them.
pub const OUTPUT_FIELDS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "max_new_tokens",
];

fn int_field(v: Option<&Value>, name: &'static str) -> Result<Option<i64>, GovernError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) => Ok(Some(v)),
            None if n.as_u64().is_some() => Ok(Some(i64::MAX)),
            None => Err(GovernError::invalid(
                Some(name),
                format!("`{name}` must be an integer, got {n}"),
            )),
        },
        Some(other) => Err(GovernError::invalid(
            Some(name),
            format!("`{name}` must be an integer, got {}", type_name(other)),
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn token_ids(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

fn parse_prompt(v: Option<&Value>) -> Result<Prompts, GovernError> {
    let bad = |m: &str| GovernError::invalid(Some("prompt"), m.to_string());
    let v = v.ok_or_else(|| bad("`prompt` is required"))?;
    let p = match v {
        Value::String(s) => Prompts::Texts(vec![s.clone()]),
        Value::Array(a) if a.is_empty() => return Err(bad("`prompt` is an empty list")),
        Value::Array(a) if a.iter().all(Value::is_string) => Prompts::Texts(
            a.iter()
                .map(|x| x.as_str().unwrap_or_default().to_string())
                .collect(),
        ),
        Value::Array(a) if a.iter().all(Value::is_number) => {
            Prompts::Tokens(vec![token_ids(a)
                .ok_or_else(|| bad("`prompt` token ids must be integers in 0..2^32"))?])
        }
        Value::Array(a) if a.iter().all(Value::is_array) => Prompts::Tokens(
            a.iter()
                .map(|x| {
                    token_ids(x.as_array().map(Vec::as_slice).unwrap_or_default())
                        .filter(|t| !t.is_empty())
                        .ok_or_else(|| {
                            bad("`prompt` token id lists must be non-empty integers in 0..2^32")
                        })
                })
                .collect::<Result<_, _>>()?,
        ),
        other => {
            return Err(bad(&format!(
                "`prompt` must be a string, a list of strings or token ids, got {}",
                type_name(other)
            )))
        }
    };
    let empty = match &p {
        Prompts::Texts(v) => v.iter().any(String::is_empty),
        Prompts::Tokens(v) => v.iter().any(Vec::is_empty),
        Prompts::Messages(_) => false,
    };
    if empty {
        return Err(bad("`prompt` is empty"));
    }
    Ok(p)
}

fn parse_messages(v: Option<&Value>) -> Result<Prompts, GovernError> {
    let bad = |m: String| GovernError::invalid(Some("messages"), m);
    let Some(Value::Array(a)) = v else {
        return Err(bad("`messages` is required and must be a list".into()));
    };
    if a.is_empty() {
        return Err(bad("`messages` is empty".into()));
    }
    for (i, m) in a.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(bad(format!("`messages[{i}]` must be an object")));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(bad(format!("`messages[{i}].role` must be a string")));
        }
        match obj.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) | Some(Value::Array(_)) => {}
            Some(other) => {
                return Err(bad(format!(
                    "`messages[{i}].content` must be a string or a list of parts, got {}",
                    type_name(other)
                )))
            }
        }
    }
    Ok(Prompts::Messages(ChatText::default()))
}

/// Parses and validates `body` for `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, GovernError> {
    parse_bytes(endpoint, bytes::Bytes::copy_from_slice(body))
}

/// [`parse`] of a body already in [`bytes::Bytes`] (kept, not copied).
pub fn parse_bytes(endpoint: Endpoint, body: bytes::Bytes) -> Result<ParsedRequest, GovernError> {
    let text = std::str::from_utf8(&body)
        .map_err(|e| GovernError::invalid(None, format!("the request body is not UTF-8: {e}")))?;
    // Only an object is a request; anything else valid is named as such.
    if !text.trim_start().starts_with('{') {
        serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| {
            GovernError::invalid(None, format!("the request body is not valid JSON: {e}"))
        })?;
        return Err(GovernError::invalid(
            None,
            "the request body must be a JSON object",
        ));
    }
    let fields: Fields = serde_json::from_str(text).map_err(|e| {
        GovernError::invalid(None, format!("the request body is not valid JSON: {e}"))
    })?;
    let prompts = match endpoint {
        Endpoint::Completions => parse_prompt(fields.prompt.as_ref())?,
        Endpoint::Chat => {
            parse_messages(fields.messages.as_ref())?;
            let msgs = fields.messages.as_ref().and_then(Value::as_array);
            Prompts::Messages(flatten_chat(
                &fields.tool_fields(),
                msgs.map(Vec::as_slice).unwrap_or_default(),
            ))
        }
    };
    let mut output_fields = Vec::new();
    let mut largest: Option<u64> = None;
    let mut unbounded = false;
    for (&field, v) in OUTPUT_FIELDS.iter().zip(fields.output()) {
        let Some(v) = int_field(v, field)? else {
            continue;
        };
        output_fields.push((field, v));
        match v {
            // llama.cpp: -1 (or 0) generates until the end of the context.
            v if field == "n_predict" && v < 1 => unbounded = true,
            v if v < 1 => {
                return Err(GovernError::invalid(
                    Some(field),
                    format!("`{field}` must be at least 1, got {v}"),
                ))
            }
            v => largest = largest.max(Some(v as u64)),
        }
    }
    let max_tokens = if unbounded { None } else { largest };
    let field = match endpoint {
        Endpoint::Chat if output_fields.iter().any(|f| f.0 == "max_completion_tokens") => {
            "max_completion_tokens"
        }
        _ => "max_tokens",
    };
    let min_tokens = match int_field(fields.min_tokens.as_ref(), "min_tokens")? {
        Some(v) if v < 0 => {
            return Err(GovernError::invalid(
                Some("min_tokens"),
                format!("`min_tokens` must be at least 0, got {v}"),
            ))
        }
        v => v.map(|v| v as u64),
    };
    let mut n = 1;
    for (name, v) in [
        ("n", fields.n.as_ref()),
        ("best_of", fields.best_of.as_ref()),
    ] {
        match int_field(v, name)? {
            None => {}
            Some(v) if (1..=MAX_N as i64).contains(&v) => n = n.max(v as u64),
            Some(v) => {
                return Err(GovernError::invalid(
                    Some(name),
                    format!("`{name}` must be in 1..={MAX_N}, got {v}"),
                ))
            }
        }
    }
    let stream = match fields.stream {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(other) => {
            return Err(GovernError::invalid(
                Some("stream"),
                format!("`stream` must be a boolean, got {}", type_name(&other)),
            ))
        }
    };
    Ok(ParsedRequest {
        endpoint,
        raw: body,
        body: std::sync::OnceLock::new(),
        prompts,
        max_tokens,
        max_tokens_field: field,
        output_fields,
        min_tokens,
        n,
        stream,
    })
}

/// How the output limit was decided, for the `x-envelope-max-tokens` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputDecision {
    Kept,
    Injected,
    Clamped,
}

impl OutputDecision {
    pub fn label(self) -> &'static str {
        match self {
            OutputDecision::Kept => "kept",
            OutputDecision::Injected => "injected",
            OutputDecision::Clamped => "clamped",
        }
    }
}

impl ParsedRequest {
    /// The body as a JSON object (parsed on first use).
    pub fn body(&self) -> &Map<String, Value> {
        self.body.get_or_init(|| {
            // `parse` checked it is a JSON object.
            serde_json::from_slice(&self.raw).unwrap_or_default()
        })
    }

    /// The body as it will be forwarded.
    pub fn raw(&self) -> &bytes::Bytes {
        &self.raw
    }

    /// Sets one top-level field of the body (its bytes follow).
    pub fn set_field(&mut self, name: &str, v: Value) {
        self.body();
        let mut obj = self.body.take().unwrap_or_default();
        obj.insert(name.to_string(), v);
        self.raw = bytes::Bytes::from(serde_json::to_vec(&obj).unwrap_or_default());
        self.body = std::sync::OnceLock::from(obj);
    }

    /// The body to forward: the original bytes unless the output limit
    /// must change. Every output-length field the client set above the
    /// applied limit (or unbounded) is lowered to it, so no server reads a
    /// larger one; the main field is set when the client did not; and
    /// `min_tokens` is kept at most the limit.
    pub fn body_with_max_tokens(&self, applied: u64) -> bytes::Bytes {
        let mut fields: Vec<&str> = self
            .output_fields
            .iter()
            .filter(|(_, v)| *v < 1 || *v as u64 > applied)
            .map(|(f, _)| *f)
            .collect();
        // The main field is always set: a server that ignores the others
        // would otherwise run to its own default.
        if !self
            .output_fields
            .iter()
            .any(|(f, _)| *f == self.max_tokens_field)
        {
            fields.push(self.max_tokens_field);
        }
        let min_over = self.min_tokens.is_some_and(|m| m > applied);
        if fields.is_empty() && !min_over {
            return self.raw.clone();
        }
        let mut obj = self.body().clone();
        for f in fields {
            obj.insert(f.to_string(), Value::from(applied));
        }
        if min_over {
            obj.insert("min_tokens".into(), Value::from(applied));
        }
        bytes::Bytes::from(serde_json::to_vec(&Value::Object(obj)).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(endpoint: Endpoint, body: &str) -> GovernError {
        parse(endpoint, body.as_bytes()).unwrap_err()
    }

    fn param(e: &GovernError) -> Option<String> {
        e.body()["error"]["param"].as_str().map(str::to_string)
    }

    #[test]
    fn completions_prompt_shapes() {
        let p = parse(Endpoint::Completions, br#"{"prompt":"hi","max_tokens":5}"#).unwrap();
        assert_eq!(p.prompts, Prompts::Texts(vec!["hi".into()]));
        assert_eq!(p.max_tokens, Some(5));
        assert_eq!((p.n, p.stream), (1, false));
        let p = parse(Endpoint::Completions, br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(p.prompts, Prompts::Tokens(vec![vec![1, 2, 3]]));
        let p = parse(Endpoint::Completions, br#"{"prompt":[[1],[2,3]],"n":2}"#).unwrap();
        assert_eq!(p.prompts.groups(), 2);
        assert_eq!(p.n, 2);
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":["a","b"],"stream":true}"#,
        )
        .unwrap();
        assert_eq!(p.prompts.groups(), 2);
        assert!(p.stream);
    }

    #[test]
    fn bad_prompts_name_the_field() {
        for body in [
            r#"{}"#,
            r#"{"prompt":""}"#,
            r#"{"prompt":[]}"#,
            r#"{"prompt":[""]}"#,
            r#"{"prompt":5}"#,
            r#"{"prompt":[1,-2]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[[]]}"#,
            r#"{"prompt":[99999999999]}"#,
        ] {
            let e = err(Endpoint::Completions, body);
            assert_eq!(e.status().as_u16(), 400, "{body}");
            assert_eq!(param(&e).as_deref(), Some("prompt"), "{body}");
        }
    }

    #[test]
    fn body_level_errors() {
        let e = parse(Endpoint::Chat, &[0xff, 0xfe, b'{']).unwrap_err();
        assert!(e.to_string().contains("UTF-8"));
        assert!(err(Endpoint::Chat, "{not json")
            .to_string()
            .contains("JSON"));
        assert!(err(Endpoint::Chat, "[1,2]").to_string().contains("object"));
    }

    #[test]
    fn max_tokens_and_n_validation() {
        for (body, p) in [
            (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":-5}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":"10"}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":1.5}"#, "max_tokens"),
            (r#"{"prompt":"x","n":0}"#, "n"),
            (r#"{"prompt":"x","n":1000}"#, "n"),
            (r#"{"prompt":"x","stream":"yes"}"#, "stream"),
        ] {
            assert_eq!(
                param(&err(Endpoint::Completions, body)).as_deref(),
                Some(p),
                "{body}"
            );
        }
        // Absurdly large is valid here; the output cap decides (clamp or reject).
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":"x","max_tokens":18446744073709551615}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(i64::MAX as u64));
        // null counts as absent.
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":"x","max_tokens":null}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, None);
    }

    #[test]
    fn chat_messages_and_max_completion_tokens() {
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7,"max_tokens":9}"#,
        )
        .unwrap();
        // The largest output field counts: a server may read either.
        assert_eq!(p.max_tokens, Some(9));
        assert_eq!(p.max_tokens_field, "max_completion_tokens");
        for body in [
            r#"{"messages":[]}"#,
            r#"{"messages":"hi"}"#,
            r#"{"messages":[{"content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":5}]}"#,
            r#"{"messages":[3]}"#,
        ] {
            assert_eq!(
                param(&err(Endpoint::Chat, body)).as_deref(),
                Some("messages"),
                "{body}"
            );
        }
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        let Prompts::Messages(c) = &p.prompts else {
            panic!()
        };
        assert_eq!(c.messages, vec![("user".to_string(), "ab".to_string())]);
    }

    fn message(e: &GovernError) -> String {
        e.body()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    #[test]
    fn only_an_object_with_each_read_field_once_is_a_request() {
        // A server reading the first of two `max_tokens` and a governor
        // reading the last would disagree on the output length.
        for f in ["max_tokens", "n", "prompt", "stream"] {
            let body = format!(r#"{{"prompt":"x","{f}":1,"{f}":5000}}"#);
            let e = err(Endpoint::Completions, &body);
            assert!(
                message(&e).contains(&format!("duplicate field `{f}`")),
                "{body}: {}",
                message(&e)
            );
        }
        // Fields it does not read are the upstream's, twice or not.
        assert!(parse(
            Endpoint::Completions,
            br#"{"prompt":"x","user":"a","user":"b"}"#
        )
        .is_ok());
        // A list would read as a struct by position.
        for body in [r#"["x", 1]"#, r#" [{"prompt":"x"}]"#, "7", r#""x""#] {
            let e = err(Endpoint::Completions, body);
            assert_eq!(
                message(&e),
                "the request body must be a JSON object",
                "{body}"
            );
        }
        assert!(message(&err(Endpoint::Completions, "[1,")).contains("not valid JSON"));
        // A field set to null is present: named, not taken for missing.
        let e = err(Endpoint::Completions, r#"{"prompt":null}"#);
        assert!(message(&e).contains("got null"), "{}", message(&e));
        let body = br#"{"prompt":"x","stream":null,"max_tokens":null}"#;
        assert!(
            parse(Endpoint::Completions, body).is_ok(),
            "null optional fields are allowed"
        );
    }

    #[test]
    fn a_field_it_does_not_read_is_checked_as_a_map_would_be() {
        // Found by the request fuzz target: a number out of range in a
        // field skipped unchecked let the body in, and the map made later
        // for a rewrite came out empty.
        for body in [
            r#"{"prompt":"x","other":939E500}"#,
            r#"{"prompt":"x","other":[1,{"a":-1e999}]}"#,
            r#"{"prompt":"x","other":"\ud800"}"#,
        ] {
            assert!(serde_json::from_str::<Value>(body).is_err(), "{body}");
            let e = err(Endpoint::Completions, body);
            assert!(
                message(&e).contains("not valid JSON"),
                "{body}: {}",
                message(&e)
            );
        }
        let body = br#"{"prompt":"x","other":[1e300,{"a":"\u00e9"}],"max_tokens":9}"#;
        let p = parse(Endpoint::Completions, body).unwrap();
        let v: Value = serde_json::from_slice(&p.body_with_max_tokens(3)).unwrap();
        assert_eq!(v["other"][1]["a"], "\u{e9}");
        assert_eq!(
            (v["prompt"].as_str(), v["max_tokens"].as_u64()),
            (Some("x"), Some(3))
        );
    }

    #[test]
    fn the_body_map_is_made_on_demand_and_follows_a_set_field() {
        let raw = br#"{"prompt":"x","model":"a","temperature":0}"#;
        let mut p = parse(Endpoint::Completions, raw).unwrap();
        assert_eq!(p.body()["temperature"], 0);
        assert_eq!(p.raw().as_ref(), raw);
        p.set_field("model", Value::from("b"));
        assert_eq!(p.body()["model"], "b");
        let v: Value = serde_json::from_slice(p.raw()).unwrap();
        assert_eq!(v["model"], "b");
        assert_eq!(v["temperature"], 0);
        // The rewrite of the output limit starts from the new body.
        let v: Value = serde_json::from_slice(&p.body_with_max_tokens(7)).unwrap();
        assert_eq!(
            (v["model"].as_str(), v["max_tokens"].as_u64()),
            (Some("b"), Some(7))
        );
    }

    #[test]
    fn unknown_fields_pass_through_and_bytes_are_kept_unless_changed() {
        let raw =
            bytes::Bytes::from_static(br#"{"prompt":"x", "max_tokens":4, "frobnicate":true}"#);
        let p = parse(Endpoint::Completions, &raw).unwrap();
        assert_eq!(p.body_with_max_tokens(4), raw);
        let changed = p.body_with_max_tokens(2);
        let v: Value = serde_json::from_slice(&changed).unwrap();
        assert_eq!(v["max_tokens"], 2);
        assert_eq!(v["frobnicate"], true);
        let raw = bytes::Bytes::from_static(br#"{"messages":[{"role":"user","content":"x"}]}"#);
        let p = parse(Endpoint::Chat, &raw).unwrap();
        let v: Value = serde_json::from_slice(&p.body_with_max_tokens(3)).unwrap();
        assert_eq!(v["max_tokens"], 3);
        assert_eq!(OutputDecision::Clamped.label(), "clamped");
    }
}
