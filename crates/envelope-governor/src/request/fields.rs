//! The request fields the governor reads, deserialized by name into a
//! struct (a parse into a map of values cost measurably more:
//! docs/measurements/2026-12-06-governor-code-figures.md); every other
//! field is checked as a map would read it and not kept.

use super::{OUTPUT_FIELDS, TOOL_FIELDS};
use serde_json::Value;

/// The fields the governor reads, deserialized by name; every other
/// field is checked as a JSON value would be (numbers in range included)
/// without being kept, and forwarded untouched (a parse into a map of
/// values cost more; see the module's note). A field
/// the governor reads, set twice, is refused: a server that reads the
/// first and a governor that read the last would disagree.
#[derive(Default)]
pub(super) struct Fields {
    pub(super) prompt: Option<Value>,
    pub(super) messages: Option<Value>,
    pub(super) tools: Option<Value>,
    pub(super) functions: Option<Value>,
    pub(super) tool_choice: Option<Value>,
    pub(super) max_tokens: Option<Value>,
    pub(super) max_completion_tokens: Option<Value>,
    pub(super) n_predict: Option<Value>,
    pub(super) max_new_tokens: Option<Value>,
    pub(super) min_tokens: Option<Value>,
    pub(super) n: Option<Value>,
    pub(super) best_of: Option<Value>,
    pub(super) stream: Option<Value>,
}

/// The names [`Fields`] reads, in its order; any other is `None`.
const READ_FIELDS: [&str; 13] = [
    "prompt",
    "messages",
    "tools",
    "functions",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "max_new_tokens",
    "min_tokens",
    "n",
    "best_of",
    "stream",
];

/// A key of the request object: which of [`READ_FIELDS`] it is.
struct Key(Option<usize>);

impl<'de> serde::Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Key, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Key, E> {
                // A match, not a search of the list: compiled to a switch
                // on the length, then one comparison.
                Ok(Key(match v {
                    "prompt" => Some(0),
                    "messages" => Some(1),
                    "tools" => Some(2),
                    "functions" => Some(3),
                    "tool_choice" => Some(4),
                    "max_tokens" => Some(5),
                    "max_completion_tokens" => Some(6),
                    "n_predict" => Some(7),
                    "max_new_tokens" => Some(8),
                    "min_tokens" => Some(9),
                    "n" => Some(10),
                    "best_of" => Some(11),
                    "stream" => Some(12),
                    _ => None,
                }))
            }
        }
        d.deserialize_identifier(V)
    }
}

/// Any JSON value, checked as [`Value`] would read it (serde's
/// `IgnoredAny` skips numbers without checking their range, so a body it
/// accepts could fail to parse into a map later) and not kept.
struct Checked;

impl<'de> serde::Deserialize<'de> for Checked {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Checked, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Checked;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_unit<E>(self) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_none<E>(self) -> Result<Checked, E> {
                Ok(Checked)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Checked, D::Error> {
                <Checked as serde::Deserialize>::deserialize(d)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Checked, A::Error> {
                while a.next_element::<Checked>()?.is_some() {}
                Ok(Checked)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Checked, A::Error> {
                while a.next_entry::<Checked, Checked>()?.is_some() {}
                Ok(Checked)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> serde::Deserialize<'de> for Fields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Fields, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Fields;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Fields, A::Error> {
                let mut f = Fields::default();
                while let Some(Key(k)) = a.next_key::<Key>()? {
                    let Some(k) = k else {
                        a.next_value::<Checked>()?;
                        continue;
                    };
                    let slot = match k {
                        0 => &mut f.prompt,
                        1 => &mut f.messages,
                        2 => &mut f.tools,
                        3 => &mut f.functions,
                        4 => &mut f.tool_choice,
                        5 => &mut f.max_tokens,
                        6 => &mut f.max_completion_tokens,
                        7 => &mut f.n_predict,
                        8 => &mut f.max_new_tokens,
                        9 => &mut f.min_tokens,
                        10 => &mut f.n,
                        11 => &mut f.best_of,
                        _ => &mut f.stream,
                    };
                    if slot.is_some() {
                        return Err(serde::de::Error::duplicate_field(READ_FIELDS[k]));
                    }
                    // Present, `null` included (not taken for missing).
                    *slot = Some(a.next_value::<Value>()?);
                }
                Ok(f)
            }
        }
        d.deserialize_map(V)
    }
}

impl Fields {
    /// The output-length fields, in [`OUTPUT_FIELDS`]' order.
    pub(super) fn output(&self) -> [Option<&Value>; OUTPUT_FIELDS.len()] {
        [
            self.max_tokens.as_ref(),
            self.max_completion_tokens.as_ref(),
            self.n_predict.as_ref(),
            self.max_new_tokens.as_ref(),
        ]
    }

    /// The request's tool fields that add prompt tokens ([`TOOL_FIELDS`]).
    pub(super) fn tool_fields(&self) -> [Option<&Value>; TOOL_FIELDS.len()] {
        [
            self.tools.as_ref(),
            self.functions.as_ref(),
            self.tool_choice.as_ref(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_name_finds_its_own_slot() {
        for (i, name) in READ_FIELDS.iter().enumerate() {
            let Key(k) = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(k, Some(i), "{name}");
        }
        for other in ["model", "Prompt", "max_token", ""] {
            let Key(k) = serde_json::from_str(&format!("\"{other}\"")).unwrap();
            assert_eq!(k, None, "{other}");
        }
    }
}
