//! From a call to its starting tier: the signals a request carries and the
//! rules over them. Below every rule's threshold a call starts on the
//! cheapest tier; when several rules match, the most capable tier any of
//! them names wins, so raising one signal past its threshold can only move
//! a call up. Pure functions.

use super::config::{RuleConfig, TiersSettings};
use serde_json::{Map, Value};

/// What routing looks at.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Signals {
    pub prompt_tokens: u64,
    /// The client's output limit, if it set one.
    pub max_tokens: Option<u64>,
    pub messages: u64,
    /// Attached documents: `documents` entries and file parts of messages.
    pub documents: u64,
    pub tools: bool,
    /// `response_format` asks for JSON (an object or a schema).
    pub json: bool,
    pub hint: Option<String>,
    pub feature: Option<String>,
    pub escalated_before: bool,
}

/// Where a call starts and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Index into the file's `order`.
    pub tier: usize,
    /// The rule that set it, or `default`.
    pub reason: String,
    /// No escalation, no fallback.
    pub pinned: bool,
}

/// Content part types that carry a document rather than text or media.
const DOCUMENT_PARTS: &[&str] = &["file", "input_file", "document"];

/// The body's own signals (tokens and headers are added by the caller).
pub fn body_signals(body: &Map<String, Value>) -> Signals {
    let messages = body.get("messages").and_then(Value::as_array);
    let file_parts = messages
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|p| {
            p.get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| DOCUMENT_PARTS.contains(&t))
        })
        .count() as u64;
    let documents = body
        .get("documents")
        .and_then(Value::as_array)
        .map_or(0, |d| d.len() as u64);
    let tools = ["tools", "functions"].iter().any(|k| {
        body.get(*k)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
    });
    Signals {
        messages: messages.map_or(0, |m| m.len() as u64),
        documents: documents + file_parts,
        tools,
        json: wants_json(body),
        ..Signals::default()
    }
}

/// `response_format` of type `json_object` or `json_schema`.
pub fn wants_json(body: &Map<String, Value>) -> bool {
    body.get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        .is_some_and(|t| t == "json_object" || t == "json_schema")
}

fn matches(r: &RuleConfig, s: &Signals) -> bool {
    let over = |limit: Option<u64>, v: u64| limit.is_none_or(|l| v > l);
    over(r.prompt_tokens_over, s.prompt_tokens)
        && r.max_tokens_over
            .is_none_or(|l| s.max_tokens.is_some_and(|m| m > l))
        && over(r.messages_over, s.messages)
        && over(r.documents_over, s.documents)
        && r.tools.is_none_or(|t| t == s.tools)
        && r.json.is_none_or(|j| j == s.json)
        && r.hint.as_ref().is_none_or(|h| s.hint.as_ref() == Some(h))
        && r.features
            .as_ref()
            .is_none_or(|fs| s.feature.as_ref().is_some_and(|f| fs.contains(f)))
        && r.escalated_before.is_none_or(|e| e == s.escalated_before)
}

/// The starting tier of a call with `signals`.
pub fn route(f: &TiersSettings, signals: &Signals) -> Route {
    let mut best = Route {
        tier: 0,
        reason: "default".into(),
        pinned: false,
    };
    let mut matched = false;
    for r in f.rules.iter().filter(|r| matches(r, signals)) {
        let Some(tier) = f.index(&r.tier) else {
            continue;
        };
        // A pinned rule that matches keeps its pin even when another rule
        // names the same tier.
        if !matched || tier > best.tier {
            best = Route {
                tier,
                reason: r.name.clone(),
                pinned: r.pin,
            };
            matched = true;
        } else if tier == best.tier && r.pin {
            best.pinned = true;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn file() -> TiersSettings {
        let text = r#"
version = "v1"
order = ["small", "standard", "large"]
[tiers.small]
upstreams = [{ url = "http://127.0.0.1:1", profile = "s.json" }]
[tiers.standard]
upstreams = [{ url = "http://127.0.0.1:2", profile = "m.json" }]
[tiers.large]
upstreams = [{ url = "http://127.0.0.1:3", profile = "l.json" }]
[[rules]]
name = "long-prompt"
tier = "large"
prompt_tokens_over = 1000
[[rules]]
name = "long-output"
tier = "standard"
max_tokens_over = 256
[[rules]]
name = "many-messages"
tier = "standard"
messages_over = 10
[[rules]]
name = "documents"
tier = "large"
documents_over = 2
[[rules]]
name = "tools"
tier = "standard"
tools = true
pin = true
[[rules]]
name = "json"
tier = "standard"
json = true
[[rules]]
name = "hinted"
tier = "large"
hint = "hard"
[[rules]]
name = "planner"
tier = "large"
features = ["planner", "review"]
[[rules]]
name = "escalated"
tier = "standard"
escalated_before = true
"#;
        TiersSettings::from_toml(text, Path::new("t.toml")).unwrap()
    }

    fn at(s: Signals) -> (usize, String, bool) {
        let r = route(&file(), &s);
        (r.tier, r.reason, r.pinned)
    }

    #[test]
    fn below_every_threshold_a_call_starts_cheapest() {
        let s = Signals {
            prompt_tokens: 1000,
            max_tokens: Some(256),
            messages: 10,
            documents: 2,
            ..Signals::default()
        };
        assert_eq!(at(s), (0, "default".into(), false));
    }

    #[test]
    fn each_signal_moves_a_call_to_its_rules_tier() {
        let base = Signals::default();
        let cases: Vec<(Signals, usize, &str)> = vec![
            (
                Signals {
                    prompt_tokens: 1001,
                    ..base.clone()
                },
                2,
                "long-prompt",
            ),
            (
                Signals {
                    max_tokens: Some(257),
                    ..base.clone()
                },
                1,
                "long-output",
            ),
            (
                Signals {
                    messages: 11,
                    ..base.clone()
                },
                1,
                "many-messages",
            ),
            (
                Signals {
                    documents: 3,
                    ..base.clone()
                },
                2,
                "documents",
            ),
            (
                Signals {
                    tools: true,
                    ..base.clone()
                },
                1,
                "tools",
            ),
            (
                Signals {
                    json: true,
                    ..base.clone()
                },
                1,
                "json",
            ),
            (
                Signals {
                    hint: Some("hard".into()),
                    ..base.clone()
                },
                2,
                "hinted",
            ),
            (
                Signals {
                    hint: Some("easy".into()),
                    ..base.clone()
                },
                0,
                "default",
            ),
            (
                Signals {
                    feature: Some("review".into()),
                    ..base.clone()
                },
                2,
                "planner",
            ),
            (
                Signals {
                    feature: Some("summary".into()),
                    ..base.clone()
                },
                0,
                "default",
            ),
            (
                Signals {
                    escalated_before: true,
                    ..base.clone()
                },
                1,
                "escalated",
            ),
        ];
        for (s, tier, reason) in cases {
            let (t, r, _) = at(s.clone());
            assert_eq!((t, r.as_str()), (tier, reason), "{s:?}");
        }
    }

    #[test]
    fn the_most_capable_matching_rule_wins_and_pins_stick() {
        let s = Signals {
            tools: true,
            json: true,
            ..Signals::default()
        };
        // Both name `standard`; the tools rule pins it.
        assert_eq!(at(s.clone()), (1, "tools".into(), true));
        let s = Signals {
            prompt_tokens: 5000,
            ..s
        };
        assert_eq!(at(s), (2, "long-prompt".into(), false));
    }

    #[test]
    fn the_body_gives_messages_documents_tools_and_json() {
        let b = json!({
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "file", "file": {}}]},
                {"role": "user", "content": "plain"}
            ],
            "documents": [{"text": "a"}, {"text": "b"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_schema", "json_schema": {}}
        });
        let s = body_signals(b.as_object().unwrap());
        assert_eq!(
            (s.messages, s.documents, s.tools, s.json),
            (2, 3, true, true)
        );
        let b = json!({"prompt": "x", "tools": [], "response_format": {"type": "text"}});
        let s = body_signals(b.as_object().unwrap());
        assert_eq!(
            (s.messages, s.documents, s.tools, s.json),
            (0, 0, false, false)
        );
    }
}
