//! Token counting: for any request that parses, the estimate never
//! counts less than a byte-level tokenizer could make of any text the
//! request carries (one token per byte): every message's content and
//! other fields, the tools, each prompt string. Nothing is hidden.
#![no_main]

use envelope_governor::request::{parse, Endpoint, Prompts};
use envelope_governor::tokens::{estimate, BOUND_BYTES_PER_TOKEN};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// Bytes of every string under `v`, except inside media parts (charged
/// their configured cost instead) and part `type` tags.
fn text_bytes(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.len() as u64,
        Value::Array(a) => a.iter().map(text_bytes).sum(),
        Value::Object(o) => {
            // A content part: its text is what a server reads of it.
            if let Some(Value::String(t)) = o.get("text") {
                return t.len() as u64;
            }
            let kind = o.get("type").and_then(Value::as_str).unwrap_or("");
            let media = matches!(
                kind,
                "image_url" | "image" | "input_image" | "input_audio" | "audio" | "audio_url"
            ) && !o.get("text").is_some_and(Value::is_string);
            if media {
                return 0;
            }
            o.iter()
                .filter(|(k, _)| k.as_str() != "type" && k.as_str() != "role")
                .map(|(_, x)| text_bytes(x))
                .sum()
        }
        _ => 0,
    }
}

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let Ok(req) = parse(endpoint, data) else {
            continue;
        };
        let counts = estimate(&req, BOUND_BYTES_PER_TOKEN);
        assert_eq!(counts.len(), req.prompts.groups());
        match &req.prompts {
            Prompts::Texts(v) => {
                for (t, c) in v.iter().zip(&counts) {
                    assert!(*c >= t.len() as u64);
                }
            }
            Prompts::Tokens(v) => {
                for (t, c) in v.iter().zip(&counts) {
                    assert_eq!(*c, t.len() as u64);
                }
            }
            Prompts::Messages(_) => {
                let mut carried = text_bytes(&req.body()["messages"]);
                for f in ["tools", "functions", "tool_choice"] {
                    if let Some(v) = req.body().get(f).filter(|v| !v.is_null() && !v.is_string()) {
                        carried += text_bytes(v);
                    }
                }
                assert!(counts[0] >= carried, "{} < {carried}", counts[0]);
            }
        }
    }
});
