//! Reading a whole answer (a JSON body or an SSE stream put back together)
//! and checking it against what the call asked for: JSON when
//! `response_format` wants it, a well-formed tool call when `tool_choice`
//! requires one, no truncation when the caller forbids it. Also whether two
//! answers agree (for shadow calibration). Pure functions.

use super::config::Check;
use serde_json::{Map, Value};

pub use envelope_governor::price::Usage;

/// The first choice of an answer, put back together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AssembledAnswer {
    pub text: String,
    /// (name, arguments as sent).
    pub tool_calls: Vec<(String, String)>,
    pub finish_reason: Option<String>,
    pub usage: Option<Usage>,
    /// SSE data events (a stream without `usage` has about one per token).
    pub events: u64,
}

/// Tool calls read from one answer at most.
const MAX_TOOL_CALLS: usize = 128;

/// Adds one JSON object (a whole answer or one stream chunk) to `a`.
fn absorb(a: &mut AssembledAnswer, v: &Value) {
    let Some(c) = v
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    else {
        return;
    };
    if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
        a.finish_reason = Some(f.to_string());
    }
    if let Some(t) = c.get("text").and_then(Value::as_str) {
        a.text.push_str(t);
    }
    for part in ["message", "delta"] {
        let Some(m) = c.get(part) else { continue };
        if let Some(t) = m.get("content").and_then(Value::as_str) {
            a.text.push_str(t);
        }
        for (i, tc) in m
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let idx = tc
                .get("index")
                .and_then(Value::as_u64)
                .map_or(i, |x| x as usize);
            // An upstream's index is not trusted to size memory.
            if idx >= MAX_TOOL_CALLS {
                continue;
            }
            while a.tool_calls.len() <= idx {
                a.tool_calls.push((String::new(), String::new()));
            }
            let f = tc.get("function");
            if let Some(n) = f.and_then(|f| f.get("name")).and_then(Value::as_str) {
                a.tool_calls[idx].0.push_str(n);
            }
            if let Some(x) = f.and_then(|f| f.get("arguments")).and_then(Value::as_str) {
                a.tool_calls[idx].1.push_str(x);
            }
        }
    }
}

/// The answer in `body`: one JSON object, or (`sse`) a stream of
/// `data:` events. `None` when nothing in it is an answer.
pub fn read_answer(body: &[u8], sse: bool) -> Option<AssembledAnswer> {
    let mut a = AssembledAnswer {
        // By the governor's one reader of usage (the relay's).
        usage: envelope_governor::answer_usage::usage(body),
        ..AssembledAnswer::default()
    };
    if !sse {
        let v: Value = serde_json::from_slice(body).ok()?;
        v.get("choices")?;
        absorb(&mut a, &v);
        return Some(a);
    }
    let text = std::str::from_utf8(body).ok()?;
    let mut any = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        a.events += 1;
        let data = data.trim();
        if data == "[DONE]" {
            continue;
        }
        if let Ok(v) = serde_json::from_str::<Value>(data) {
            if v.get("error").is_some() {
                return None;
            }
            any |= v.get("choices").is_some();
            absorb(&mut a, &v);
        }
    }
    any.then_some(a)
}

/// What a call asked of its answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expect {
    pub json: bool,
    /// Tool names given; a tool call must name one of them.
    pub tools: Vec<String>,
    /// `tool_choice` requires a call (`required` or a named function).
    pub tool_required: bool,
    pub no_truncation: bool,
}

impl Expect {
    /// From the request body and the no-truncation header.
    pub fn of(body: &Map<String, Value>, no_truncation: bool) -> Expect {
        let tools = body
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| {
                t.get("function")
                    .and_then(|f| f.get("name"))
                    .or_else(|| t.get("name"))
                    .and_then(Value::as_str)
            })
            .map(str::to_string)
            .collect();
        let tool_required = match body.get("tool_choice") {
            Some(Value::String(s)) => s == "required",
            Some(Value::Object(o)) => o.get("type").and_then(Value::as_str) == Some("function"),
            _ => false,
        };
        Expect {
            json: super::route::wants_json(body),
            tools,
            tool_required,
            no_truncation,
        }
    }

    /// Whether any check applies (else an answer needs no reading).
    pub fn any(&self) -> bool {
        self.json || self.tool_required || !self.tools.is_empty() || self.no_truncation
    }
}

/// JSON text, allowing the fences models like to wrap it in.
fn parse_json(text: &str) -> Option<Value> {
    let t = text.trim();
    let t = t
        .strip_prefix("```json")
        .or_else(|| t.strip_prefix("```"))
        .and_then(|x| x.strip_suffix("```"))
        .unwrap_or(t);
    serde_json::from_str(t.trim()).ok()
}

/// The first check among `on` that `answer` fails, if any. A 5xx or no
/// answer at all is an upstream error; a 4xx is the client's own and is
/// never escalated.
pub fn check(
    on: &[Check],
    e: &Expect,
    status: u16,
    answer: Option<&AssembledAnswer>,
) -> Option<Check> {
    let failed = |c: Check| on.contains(&c).then_some(c);
    if status >= 500 {
        return failed(Check::UpstreamError);
    }
    if !(200..300).contains(&status) {
        return None;
    }
    let Some(a) = answer else {
        return failed(Check::UpstreamError);
    };
    if e.no_truncation && a.finish_reason.as_deref() == Some("length") {
        if let Some(c) = failed(Check::Truncated) {
            return Some(c);
        }
    }
    let bad_call = |(name, args): &(String, String)| {
        (!e.tools.is_empty() && !e.tools.contains(name)) || parse_json(args).is_none()
    };
    if (e.tool_required && a.tool_calls.is_empty()) || a.tool_calls.iter().any(bad_call) {
        if let Some(c) = failed(Check::ToolCall) {
            return Some(c);
        }
    }
    if e.json && a.tool_calls.is_empty() && parse_json(&a.text).is_none() {
        return failed(Check::InvalidJson);
    }
    None
}

/// How two answers are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreement {
    /// The same text, trimmed.
    Exact,
    /// Equal as JSON values.
    Json,
    /// The same tool calls (names, and arguments equal as JSON).
    ToolCall,
}

impl Agreement {
    pub fn of(e: &Expect) -> Agreement {
        if !e.tools.is_empty() {
            Agreement::ToolCall
        } else if e.json {
            Agreement::Json
        } else {
            Agreement::Exact
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Agreement::Exact => "exact",
            Agreement::Json => "json",
            Agreement::ToolCall => "tool_call",
        }
    }

    /// Whether `a` and `b` agree.
    pub fn agree(self, a: &AssembledAnswer, b: &AssembledAnswer) -> bool {
        match self {
            Agreement::Exact => a.text.trim() == b.text.trim(),
            Agreement::Json => match (parse_json(&a.text), parse_json(&b.text)) {
                (Some(x), Some(y)) => x == y,
                _ => false,
            },
            Agreement::ToolCall => {
                if a.tool_calls.is_empty() && b.tool_calls.is_empty() {
                    return a.text.trim() == b.text.trim();
                }
                a.tool_calls.len() == b.tool_calls.len()
                    && a.tool_calls.iter().zip(&b.tool_calls).all(|(x, y)| {
                        x.0 == y.0
                            && match (parse_json(&x.1), parse_json(&y.1)) {
                                (Some(p), Some(q)) => p == q,
                                _ => false,
                            }
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ALL: &[Check] = &[
        Check::InvalidJson,
        Check::ToolCall,
        Check::Truncated,
        Check::UpstreamError,
    ];

    fn chat(content: &str, finish: &str) -> Vec<u8> {
        json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
               "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                         "prompt_tokens_details": {"cached_tokens": 4}}})
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_stream_is_put_back_together() {
        let sse = "data: {\"choices\":[{\"delta\":{\"content\":\"{\\\"a\\\"\"}}]}\n\n\
                   data: {\"choices\":[{\"delta\":{\"content\":\": 1}\"},\"finish_reason\":\"stop\"}]}\n\n\
                   data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                   data: [DONE]\n\n";
        let a = read_answer(sse.as_bytes(), true).unwrap();
        assert_eq!(a.text, "{\"a\": 1}");
        assert_eq!(a.finish_reason.as_deref(), Some("stop"));
        assert_eq!(
            a.usage,
            Some(Usage {
                prompt: 5,
                completion: 2,
                cached: 0
            })
        );
        assert_eq!(a.events, 4);
        let err = "data: {\"error\":{\"message\":\"x\"}}\n\n";
        assert_eq!(read_answer(err.as_bytes(), true), None);
        let a = read_answer(&chat("hi", "stop"), false).unwrap();
        assert_eq!(a.usage.unwrap().cached, 4);
    }

    #[test]
    fn each_check_fails_what_it_should_and_only_that() {
        let json_asked = Expect {
            json: true,
            ..Expect::default()
        };
        let a = |c: &str, f: &str| read_answer(&chat(c, f), false);
        assert_eq!(
            check(ALL, &json_asked, 200, a("not json", "stop").as_ref()),
            Some(Check::InvalidJson)
        );
        assert_eq!(
            check(
                ALL,
                &json_asked,
                200,
                a("```json\n{\"k\": [1]}\n```", "stop").as_ref()
            ),
            None
        );
        assert_eq!(
            check(
                &[Check::ToolCall],
                &json_asked,
                200,
                a("nope", "stop").as_ref()
            ),
            None
        );
        let whole = Expect {
            no_truncation: true,
            ..Expect::default()
        };
        assert_eq!(
            check(ALL, &whole, 200, a("cut", "length").as_ref()),
            Some(Check::Truncated)
        );
        assert_eq!(
            check(ALL, &Expect::default(), 200, a("cut", "length").as_ref()),
            None
        );
        assert_eq!(
            check(ALL, &Expect::default(), 503, None),
            Some(Check::UpstreamError)
        );
        assert_eq!(check(ALL, &Expect::default(), 400, None), None);
        assert_eq!(
            check(ALL, &Expect::default(), 200, None),
            Some(Check::UpstreamError)
        );
        let body = json!({"tools": [{"type": "function", "function": {"name": "get"}}], "tool_choice": "required"});
        let tools = Expect::of(body.as_object().unwrap(), false);
        assert!(tools.tool_required);
        assert_eq!(
            check(ALL, &tools, 200, a("text only", "stop").as_ref()),
            Some(Check::ToolCall)
        );
        let call = |name: &str, args: &str| {
            json!({"choices": [{"message": {"tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}, "finish_reason": "tool_calls"}]})
                .to_string()
        };
        let ok = read_answer(call("get", "{\"q\": 1}").as_bytes(), false);
        assert_eq!(check(ALL, &tools, 200, ok.as_ref()), None);
        let bad = read_answer(call("get", "{\"q\": ").as_bytes(), false);
        assert_eq!(check(ALL, &tools, 200, bad.as_ref()), Some(Check::ToolCall));
        let unknown = read_answer(call("rm", "{}").as_bytes(), false);
        assert_eq!(
            check(ALL, &tools, 200, unknown.as_ref()),
            Some(Check::ToolCall)
        );
    }

    #[test]
    fn agreement_compares_as_the_call_asked() {
        let ans = |t: &str| AssembledAnswer {
            text: t.into(),
            ..AssembledAnswer::default()
        };
        assert!(Agreement::Json.agree(&ans("{\"a\":1, \"b\":2}"), &ans(" {\"b\": 2, \"a\": 1}")));
        assert!(!Agreement::Json.agree(&ans("{\"a\":1}"), &ans("{\"a\":2}")));
        assert!(!Agreement::Json.agree(&ans("x"), &ans("x")));
        assert!(Agreement::Exact.agree(&ans("yes "), &ans("yes")));
        assert!(!Agreement::Exact.agree(&ans("yes"), &ans("no")));
        let call = |n: &str, a: &str| AssembledAnswer {
            tool_calls: vec![(n.into(), a.into())],
            ..AssembledAnswer::default()
        };
        assert!(Agreement::ToolCall.agree(&call("f", "{\"x\":1}"), &call("f", "{ \"x\": 1 }")));
        assert!(!Agreement::ToolCall.agree(&call("f", "{\"x\":1}"), &call("g", "{\"x\":1}")));
    }
}
