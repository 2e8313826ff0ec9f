//! Agents' traffic for the tests beside foreign servers (seed 000,
//! section 7): each client runs sessions, a session is a system prompt
//! shared by every session of its version, then calls that each add a
//! tool result and send the conversation so far, the previous answers in
//! it. A server with a prefix cache computes only what is new in a call.

use super::{in_threads, one_request, Outcome, SENTENCES};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Calls a session makes.
pub(super) const CALLS: usize = 3;
/// Output tokens of each call.
pub(super) const OUTPUT: u64 = 16;

/// The size of an agent's session.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    /// Sentences of the system prompt (about 13 words each).
    pub system_sentences: usize,
    pub calls: usize,
    /// Sentences of each tool result.
    pub tool_sentences: usize,
    pub output: u64,
}

/// The CI tests' sessions: a system prompt of about 285 tokens, three
/// calls of a sentence each, 16 tokens out.
pub(super) const CI: Shape = Shape {
    system_sentences: 20,
    calls: CALLS,
    tool_sentences: 1,
    output: OUTPUT,
};

/// Sessions' numbers, never reused within a run (a tool result seen before
/// could find its blocks in the server's cache).
static NEXT_SESSION: AtomicU64 = AtomicU64::new(0);

/// The system prompt every session of `version` shares, of `sentences`
/// sentences (the CI shape's 20: about 285
/// tokens with the chat template, past two of vLLM's CPU blocks of 128).
fn system_prompt_of(version: u64, sentences: usize) -> String {
    let body: Vec<&str> = SENTENCES.iter().cycle().take(sentences).copied().collect();
    format!(
        "You are the operations agent, prompt version {version}. {} Answer in one short sentence.",
        body.join(" ")
    )
}

/// Call `call`'s tool result in session `session`: its own numbers first,
/// then a sentence (about 25 tokens with the template).
fn tool_result(session: u64, call: usize, sentences: usize) -> String {
    let body: Vec<&str> = (0..sentences)
        .map(|i| SENTENCES[(session as usize + call + i) % SENTENCES.len()])
        .collect();
    format!(
        "Tool result {session}.{call}: {} What next?",
        body.join(" ")
    )
}

/// A call's body: the conversation so far, streamed.
pub(super) fn call_body(messages: &[Value], output: u64) -> Value {
    json!({"model": "smollm2", "messages": messages, "max_tokens": output, "stream": true})
}

/// `clients` agents against `base`, each running `sessions` sessions of
/// the system prompt version `version` holds when the session starts
/// (so a test can change it halfway), until each is done or `cap` passes.
/// A refused call waits its Retry-After (at most 2 s, in `one_request`)
/// and is asked again, as an agent does. Every request's outcome, the
/// refused ones too.
pub(super) fn agents(
    base: &str,
    clients: usize,
    sessions: usize,
    cap: Duration,
    version: Arc<AtomicU64>,
) -> Vec<Outcome> {
    agents_shaped(base, clients, sessions, cap, version, CI)
}

/// [`agents`] with sessions of `shape`.
pub(super) fn agents_shaped(
    base: &str,
    clients: usize,
    sessions: usize,
    cap: Duration,
    version: Arc<AtomicU64>,
    shape: Shape,
) -> Vec<Outcome> {
    let started = Instant::now();
    let stop = started + cap;
    let url = format!("{base}/v1/chat/completions");
    in_threads(clients, move |client| {
        let mut out: Vec<Outcome> = vec![];
        'sessions: for _ in 0..sessions {
            let session = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
            let v = version.load(Ordering::Relaxed);
            let system = system_prompt_of(v, shape.system_sentences);
            let mut messages = vec![json!({"role": "system", "content": system})];
            for call in 0..shape.calls {
                let tool = tool_result(session, call, shape.tool_sentences);
                messages.push(json!({"role": "user", "content": tool}));
                loop {
                    if Instant::now() >= stop || out.len() >= 500 {
                        break 'sessions;
                    }
                    let mut o = one_request(client, &url, &call_body(&messages, shape.output));
                    o.end_s = started.elapsed().as_secs_f64();
                    let (status, text) = (o.status, std::mem::take(&mut o.text));
                    out.push(o);
                    match status {
                        200 => {
                            messages.push(json!({"role": "assistant", "content": text}));
                            break;
                        }
                        429 | 503 => continue,
                        _ => continue 'sessions,
                    }
                }
            }
        }
        out
    })
}

/// The longest prompt a session sends, as `count` counts a chat's
/// messages: the system prompt and every call's tool result and a full
/// answer of `OUTPUT` tokens (`answer` stands in for one).
pub(super) fn longest_prompt(count: &dyn Fn(&Value) -> u64, answer: &str) -> u64 {
    longest_prompt_of(count, answer, CI)
}

/// [`longest_prompt`] of sessions of `shape`.
pub(super) fn longest_prompt_of(count: &dyn Fn(&Value) -> u64, answer: &str, shape: Shape) -> u64 {
    let system = system_prompt_of(999, shape.system_sentences);
    let mut messages = vec![json!({"role": "system", "content": system})];
    for call in 0..shape.calls {
        let tool = tool_result(999_999, call, shape.tool_sentences);
        messages.push(json!({"role": "user", "content": tool}));
        if call + 1 < shape.calls {
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    count(&Value::Array(messages))
}
