//! What passes between a load generator and a target: one request
//! ([`LoadRequest`]), what was measured of it ([`RequestRecord`]), the
//! server's state ([`Snapshot`]), and the [`Driver`] that serves requests
//! (the in-process engine or a server over HTTP).

use std::time::{Duration, Instant};

#[derive(Debug, Clone, Default)]
pub struct RequestRecord {
    pub worker: u32,
    /// Seconds from the probe start to submission.
    pub start_s: f64,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    pub itl_s: Vec<f64>,
    pub input_tokens: u32,
    /// Prompt tokens the server found in its prefix cache, where its answer
    /// says (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u32>,
    pub output_tokens: u32,
    pub preemptions: u32,
    /// The finish reason the server (or engine) sent, when it sent one.
    pub finish_reason: Option<String>,
    /// Agent-shaped load: the task class and the run (session) of the call.
    pub class: Option<String>,
    pub run: u32,
    /// A replayed trace's tenant of the call.
    pub tenant: Option<String>,
    /// `reason: detail` (see [`crate::truth`]); None for a whole answer.
    pub error: Option<String>,
    /// A refusal (429 with Retry-After; the error's reason is `refused`):
    /// the seconds the server asked the client to wait.
    pub retry_after_s: Option<f64>,
    /// The answer came through `envelope govern` (it has its headers).
    pub governed: bool,
    /// Sent while a closed loop's workers were still ramping in (before
    /// the last one started): kept in `requests.csv`, left out of the
    /// probe's latency verdicts, which are about the level itself.
    pub warmup: bool,
}

/// One request of a probe.
#[derive(Debug, Clone)]
pub struct LoadRequest {
    pub prompt_tokens: Vec<u32>,
    /// A dataset prompt for a target that takes text and has no tokenizer
    /// here (http, launch): sent as is; its length is the server's count.
    pub prompt_text: Option<String>,
    pub output_tokens: u32,
}

/// What the monitor reads from the server while a probe runs; `None` where
/// the target cannot tell.
#[derive(Debug, Clone, Copy, Default)]
pub struct Snapshot {
    /// KV-cache use, 0..1.
    pub kv_usage: Option<f64>,
    pub preemptions_total: Option<u64>,
    /// Memory of the serving process (host RSS) or of the GPU (NVML).
    pub memory_bytes: Option<u64>,
    /// The server's prefix-cache counters (prompt tokens looked up, and
    /// found), where it exports them.
    pub prefix_cache: Option<PrefixCache>,
}

/// Prefix-cache counters since the server started, in prompt tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefixCache {
    pub queries: f64,
    pub hits: f64,
}

/// Something that serves requests: the embedded engine or a server.
pub trait Driver: Send + Sync {
    /// Token ids of synthetic prompts stay below this.
    fn vocab_size(&self) -> usize;
    /// The served model's token ids for `text`, where this side has its
    /// tokenizer (the embedded engine); `None` otherwise.
    fn tokenize(&self, _text: &str) -> Option<Vec<u32>> {
        None
    }
    /// Sends one request and blocks until it ends. `rec` gets TTFT and
    /// inter-token gaps (relative to `t0`, the submission), output tokens,
    /// preemptions and errors.
    fn send(&self, req: &LoadRequest, t0: Instant, rec: &mut RequestRecord);
    /// The server's state now.
    fn snapshot(&self) -> Snapshot;
    /// Whether the server runs in this process (its CPU use is then not the
    /// load generator's).
    fn in_process(&self) -> bool {
        false
    }
    /// Whether an answer shorter than asked is an error: true unless the
    /// server was found not to honour `ignore_eos`.
    fn exact_output(&self) -> bool {
        true
    }
    /// How often the monitor reads [`Driver::snapshot`].
    fn monitor_interval(&self) -> Duration {
        Duration::from_millis(10)
    }
}
