//! The settings a flag of the same name sets, in groups by what they
//! bound: the front end's clients, the queue, the upstream call's time,
//! token counting. Each group's `Default` is its one default; a flag or a
//! config field of the same name as a group's field overrides it
//! ([`overlay`]), so adding a setting here and a flag of its name in
//! `GovernArgs` is all it takes, with no list to keep.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// How the front end treats clients: body size and time, header time,
/// connections, and the paths forwarded or open without a key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontSettings {
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// A request body must arrive within this, ms.
    pub body_timeout_ms: u64,
    /// A client's request headers must arrive within this, ms.
    pub header_read_timeout_ms: u64,
    /// Most client connections open at once; more wait to be accepted.
    pub max_connections: usize,
    /// GET paths forwarded to the upstream (exact, or a prefix ending in `*`).
    pub passthrough_paths: Vec<String>,
    /// Paths answered without an API key when keys are configured (exact,
    /// or a prefix ending in `*`): probes and scrapes. Every other route,
    /// forwarded or the governor's own, needs a known key then.
    pub public_paths: Vec<String>,
}

impl Default for FrontSettings {
    fn default() -> FrontSettings {
        FrontSettings {
            max_body_bytes: 8 << 20,
            body_timeout_ms: 30_000,
            header_read_timeout_ms: 10_000,
            max_connections: 4096,
            passthrough_paths: default_passthrough_paths(),
            public_paths: default_public_paths(),
        }
    }
}

/// The GET paths forwarded by default: model listing and health.
pub fn default_passthrough_paths() -> Vec<String> {
    [
        "/v1/models",
        "/v1/models/*",
        "/health",
        "/healthz",
        "/ready",
        "/version",
    ]
    .map(String::from)
    .to_vec()
}

/// The paths answered without an API key by default: health, readiness
/// and the governor's metrics (what a kubelet and Prometheus call).
pub fn default_public_paths() -> Vec<String> {
    ["/health", "/healthz", "/ready", "/metrics"]
        .map(String::from)
        .to_vec()
}

/// How much may wait, how long, and each class's deadline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSettings {
    /// Most requests waiting.
    pub max_queue_len: usize,
    /// Most KV tokens waiting.
    pub max_queue_tokens: u64,
    /// Longest wait in the queue, ms.
    pub max_queue_age_ms: u64,
    /// Deadline of interactive requests without one of their own, ms.
    pub interactive_deadline_ms: u64,
    /// Deadline of batch requests without one of their own, ms.
    pub batch_deadline_ms: u64,
}

impl QueueSettings {
    /// The defaults for an envelope of `kv_tokens` in flight: four times
    /// that may wait.
    pub fn for_kv_tokens(kv_tokens: u64) -> QueueSettings {
        QueueSettings {
            max_queue_len: 256,
            max_queue_tokens: kv_tokens.saturating_mul(4),
            max_queue_age_ms: 30_000,
            interactive_deadline_ms: 30_000,
            batch_deadline_ms: 300_000,
        }
    }
}

/// The time a call to the upstream, and a request as a whole, may take.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutSettings {
    /// TCP connect to the upstream, ms.
    pub connect_timeout_ms: u64,
    /// Time to the upstream's response headers, ms (a non-streaming answer
    /// sends them when it is done, so this bounds its whole generation).
    pub upstream_timeout_ms: u64,
    /// Longest gap between chunks of an upstream response before it counts
    /// as hung, ms.
    pub upstream_idle_timeout_ms: u64,
    /// A request's whole lifetime, queue and answer, ms: a stream still
    /// running then is ended with an SSE error event.
    pub max_request_ms: u64,
}

impl Default for TimeoutSettings {
    fn default() -> TimeoutSettings {
        TimeoutSettings {
            connect_timeout_ms: 5_000,
            upstream_timeout_ms: 600_000,
            upstream_idle_timeout_ms: 60_000,
            max_request_ms: 900_000,
        }
    }
}

/// Counting a request's prompt tokens: how long, how many at once, and
/// what a media part is charged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountingSettings {
    /// Counting a request's prompt tokens (one upstream /tokenize call, or
    /// the local tokenizer), ms; past it the conservative estimate counts.
    pub count_timeout_ms: u64,
    /// Requests being counted at once; more wait (within the count timeout).
    pub max_counting: usize,
    /// Prompt tokens charged per image part of a chat message.
    pub image_part_tokens: u64,
    /// Prompt tokens charged per audio part of a chat message.
    pub audio_part_tokens: u64,
}

impl Default for CountingSettings {
    fn default() -> CountingSettings {
        CountingSettings {
            count_timeout_ms: 2_000,
            max_counting: 64,
            image_part_tokens: 2048,
            audio_part_tokens: 2048,
        }
    }
}

/// `base` with each of its fields that `written` sets (a field of the
/// same name, not null) taken from `written`.
///
/// # Errors
/// A value in `written` that is not of the field's type, named.
pub fn overlay<T: Serialize + DeserializeOwned>(
    base: &T,
    written: &serde_json::Map<String, serde_json::Value>,
) -> Result<T, String> {
    let mut fields = match serde_json::to_value(base) {
        Ok(serde_json::Value::Object(m)) => m,
        Ok(_) | Err(_) => return Err("settings group is not a table".into()),
    };
    for (name, value) in fields.iter_mut() {
        if let Some(v) = written.get(name).filter(|v| !v.is_null()) {
            *value = v.clone();
        }
    }
    serde_json::from_value(serde_json::Value::Object(fields)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_takes_the_written_fields_of_a_group_and_nothing_else() {
        let written = serde_json::json!({
            "max_connections": 7,
            "public_paths": ["/x"],
            "max_queue_len": 3,
            "header_read_timeout_ms": null,
        });
        let written = written.as_object().unwrap();
        let front = overlay(&FrontSettings::default(), written).unwrap();
        assert_eq!(front.max_connections, 7);
        assert_eq!(front.public_paths, ["/x"]);
        // Null is unset; a field of another group is not this one's.
        assert_eq!(front.header_read_timeout_ms, 10_000);
        assert_eq!(front.max_body_bytes, 8 << 20);
        let queue = overlay(&QueueSettings::for_kv_tokens(100), written).unwrap();
        assert_eq!((queue.max_queue_len, queue.max_queue_tokens), (3, 400));
        let bad = serde_json::json!({"max_connections": "many"});
        let e = overlay(&FrontSettings::default(), bad.as_object().unwrap()).unwrap_err();
        assert!(e.contains("invalid type"), "{e}");
    }
}
