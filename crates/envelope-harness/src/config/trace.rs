//! `[load.trace]` as written: a recorded trace to replay after the bucket
//! search, and the time-scale factors searched (validated, with the trace
//! read, into [`crate::trace_load::TraceLoad`]).

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceConfig {
    /// The trace file: ours (JSON lines, as `envelope govern --record`
    /// writes it), Mooncake's JSON lines or BurstGPT's CSV.
    pub path: String,
    /// `envelope`, `mooncake` or `burstgpt` (default: by the file).
    pub format: Option<String>,
    /// The searched time-scale factors are multiples of `scale_step` in
    /// [scale_min, scale_max]; 2.0 replays the trace twice as fast.
    #[serde(default = "quarter")]
    pub scale_min: f64,
    #[serde(default = "quarter")]
    pub scale_step: f64,
    #[serde(default = "eight")]
    pub scale_max: f64,
    /// A probe replays at most this many seconds (default: the whole trace
    /// at the probe's factor).
    pub window_s: Option<f64>,
}

fn quarter() -> f64 {
    0.25
}

fn eight() -> f64 {
    8.0
}
