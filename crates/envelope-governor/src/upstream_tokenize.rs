//! An upstream's tokenize endpoint, in its own dialect: which servers have
//! which (found at start by `upstream::detect_dialect`), the body each
//! takes for a text,
//! and where its answer holds the count.
//!
//! | server | call | answer |
//! |---|---|---|
//! | vLLM, SGLang, `envelope serve` | `POST /tokenize` `{"prompt"}` or `{"messages"}` (template applied) | `{"count"}` |
//! | TGI | `POST /tokenize` `{"inputs"}` | a list of tokens |
//! | llama.cpp `llama-server` | `POST /tokenize` `{"content", "add_special": true}` | `{"tokens"}` |
//! | llama-cpp-python | `POST /extras/tokenize/count` `{"input"}` | `{"count"}` |
//!
//! Only vLLM's applies a chat template. For the others a chat is counted
//! as its messages' text (one call, the texts joined by newlines) plus a
//! template overhead ([`ChatOverhead`]) that `upstream::calibrate_chat` measures
//! at start from the server's own `usage.prompt_tokens` for three small
//! chats, so a template that adds a default system prompt is counted (a
//! local tokenizer's count gets the same).
//!
//! llama-cpp-python's endpoint is found but not used on the request path:
//! with its default `--interrupt_requests`, any call while a stream runs
//! (a tokenize call included) ends that stream early, so counting there
//! would cut the answers being governed.

use crate::request::ChatText;
use serde_json::{json, Value};

/// Tokens a chat template adds per message, where nothing better is known.
pub const CHAT_OVERHEAD_PER_MESSAGE: u64 = 8;
/// Tokens for the assistant turn's opening that the template appends.
pub const CHAT_OVERHEAD_REPLY: u64 = 8;

/// Which tokenize endpoint an upstream has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Vllm,
    Tgi,
    LlamaCpp,
    LlamaCppPython,
}

impl Dialect {
    /// Every dialect, in the order [`detect`] tries them.
    pub const ALL: [Dialect; 4] = [
        Dialect::Vllm,
        Dialect::LlamaCpp,
        Dialect::Tgi,
        Dialect::LlamaCppPython,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Dialect::Vllm => "vLLM /tokenize",
            Dialect::Tgi => "TGI /tokenize",
            Dialect::LlamaCpp => "llama.cpp /tokenize",
            Dialect::LlamaCppPython => "llama-cpp-python /extras/tokenize/count",
        }
    }

    /// The endpoint's path.
    pub fn path(self) -> &'static str {
        match self {
            Dialect::LlamaCppPython => "/extras/tokenize/count",
            _ => "/tokenize",
        }
    }

    /// Whether a call may be made while the server streams answers
    /// (llama-cpp-python's cuts the running stream).
    pub fn safe_beside_streams(self) -> bool {
        self != Dialect::LlamaCppPython
    }

    /// Whether the endpoint takes a chat and applies the template itself.
    pub fn takes_chats(self) -> bool {
        self == Dialect::Vllm
    }

    /// The body that asks for `text`'s count.
    pub fn text_body(self, text: &str) -> Value {
        match self {
            Dialect::Vllm => json!({ "prompt": text }),
            Dialect::Tgi => json!({ "inputs": text }),
            Dialect::LlamaCpp => json!({ "content": text, "add_special": true }),
            Dialect::LlamaCppPython => json!({ "input": text }),
        }
    }

    /// The count in an answer of this dialect; `None` when the answer is
    /// not of its shape.
    pub fn count_in(self, answer: &Value) -> Option<u64> {
        match self {
            Dialect::Vllm | Dialect::LlamaCppPython => answer.get("count")?.as_u64(),
            Dialect::LlamaCpp => answer.get("tokens")?.as_array().map(|t| t.len() as u64),
            Dialect::Tgi => answer.as_array().map(|t| t.len() as u64),
        }
    }
}

/// Tokens a chat template adds around the messages' text, for a tokenize
/// endpoint that applies none: `fixed` (or `fixed_with_system` when the
/// first message is a system one: templates that add a default system
/// prompt add it only when there is none) plus `per_message` per message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatOverhead {
    pub fixed: u64,
    pub fixed_with_system: u64,
    pub per_message: u64,
}

impl Default for ChatOverhead {
    /// The local count's constants (an over-estimate for ChatML and
    /// Llama-3 templates without a default system prompt).
    fn default() -> Self {
        ChatOverhead {
            fixed: CHAT_OVERHEAD_REPLY,
            fixed_with_system: CHAT_OVERHEAD_REPLY,
            per_message: CHAT_OVERHEAD_PER_MESSAGE,
        }
    }
}

impl ChatOverhead {
    /// The template's tokens for `chat`.
    pub fn of(&self, chat: &ChatText) -> u64 {
        let first_is_system = chat.messages.first().is_some_and(|(r, _)| r == "system");
        let fixed = if first_is_system {
            self.fixed_with_system
        } else {
            self.fixed
        };
        fixed + self.per_message * chat.messages.len() as u64
    }
}

/// A chat's messages' text, as one call counts it.
pub fn joined_text(chat: &ChatText) -> String {
    chat.messages
        .iter()
        .map(|(_, t)| t.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dialect_reads_its_own_answer_only() {
        let count = json!({"count": 7});
        let tokens = json!({"tokens": [1, 2, 3]});
        let list = json!([{"id": 1}, {"id": 2}]);
        assert_eq!(Dialect::Vllm.count_in(&count), Some(7));
        assert_eq!(Dialect::LlamaCppPython.count_in(&count), Some(7));
        assert_eq!(Dialect::LlamaCpp.count_in(&tokens), Some(3));
        assert_eq!(Dialect::Tgi.count_in(&list), Some(2));
        // llama.cpp's answer is not vLLM's: no silent 0 or 1-byte fallback.
        assert_eq!(Dialect::Vllm.count_in(&tokens), None);
        assert_eq!(Dialect::LlamaCpp.count_in(&count), None);
        assert_eq!(
            Dialect::LlamaCpp.text_body("hi"),
            json!({"content": "hi", "add_special": true})
        );
        assert_eq!(Dialect::LlamaCppPython.path(), "/extras/tokenize/count");
    }

    #[test]
    fn the_overhead_depends_on_a_leading_system_message() {
        let o = ChatOverhead {
            fixed: 20,
            fixed_with_system: 3,
            per_message: 5,
        };
        let chat = |roles: &[&str]| ChatText {
            messages: roles.iter().map(|r| (r.to_string(), "x".into())).collect(),
            media: Default::default(),
        };
        assert_eq!(o.of(&chat(&["user"])), 25);
        assert_eq!(o.of(&chat(&["system", "user"])), 13);
        assert_eq!(joined_text(&chat(&["user", "user"])), "x\nx");
    }
}
