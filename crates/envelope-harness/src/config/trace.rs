//! `[load.trace]`: a recorded trace to replay after the bucket search, and
//! the time-scale factors searched, as written ([`TraceConfig`]) and
//! validated with the trace read ([`TraceLoad`]); the replay itself is
//! [`crate::trace_load`].

use super::LoadConfig;
use envelope_profile::trace::{Trace, TraceFormat};
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

/// The validated `[load.trace]` settings with the trace read.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceLoad {
    pub trace: Trace,
    /// The searched factors are multiples of `scale_step` in [min, max].
    pub scale_min: f64,
    pub scale_step: f64,
    pub scale_max: f64,
    /// A probe replays at most this many seconds of its own time (the
    /// trace's first `window_s x factor` seconds); None: the whole trace.
    pub window_s: Option<f64>,
    pub collapse_probes: u32,
    pub collapse_fraction: f64,
    pub recovery_s: f64,
}

impl TraceLoad {
    /// `None` without `[load.trace]`; errors name the field.
    pub fn from_load(l: &LoadConfig) -> Result<Option<TraceLoad>, String> {
        let Some(t) = &l.trace else {
            return Ok(None);
        };
        let format = t
            .format
            .as_deref()
            .map(TraceFormat::parse)
            .transpose()
            .map_err(|e| format!("load.trace.format: {e}"))?;
        let trace = Trace::read(&t.path, format).map_err(|e| format!("load.trace.path: {e}"))?;
        let ok = |v: f64| v.is_finite() && v > 0.0;
        if !(ok(t.scale_step) && ok(t.scale_min) && t.scale_max >= t.scale_min) {
            return Err(format!(
                "load.trace.scale_step ({}) and load.trace.scale_min ({}) must be > 0 and load.trace.scale_max ({}) at least scale_min",
                t.scale_step, t.scale_min, t.scale_max
            ));
        }
        if let Some(w) = t.window_s.filter(|w| !ok(*w)) {
            return Err(format!("load.trace.window_s must be > 0, got {w}"));
        }
        if l.workload.is_some() {
            return Err("load.trace and load.workload: one scaled load per sweep".into());
        }
        if !(l.collapse_fraction > 0.0 && l.collapse_fraction < 1.0) {
            return Err(format!(
                "load.collapse_fraction must be in (0, 1), got {}",
                l.collapse_fraction
            ));
        }
        let load = TraceLoad {
            recovery_s: 0.0,
            trace,
            scale_min: t.scale_min,
            scale_step: t.scale_step,
            scale_max: t.scale_max,
            window_s: t.window_s,
            collapse_probes: l.collapse_probes,
            collapse_fraction: l.collapse_fraction,
        };
        let recovery_s = l
            .recovery_s
            .unwrap_or_else(|| 2.0 * load.probe_seconds(load.scale_min));
        if !ok(recovery_s) {
            return Err(format!("load.recovery_s must be > 0, got {recovery_s}"));
        }
        Ok(Some(TraceLoad { recovery_s, ..load }))
    }

    /// The searched ladder: factor = k x scale_step for k in the range.
    pub fn ladder(&self) -> (u32, u32) {
        let lo = ((self.scale_min / self.scale_step).ceil() as u32).max(1);
        let hi = ((self.scale_max / self.scale_step).floor() as u32).max(lo);
        (lo, hi)
    }

    /// The trace's length as it repeats: its span and one mean gap (the
    /// next lap's first request follows the last as the trace's do).
    pub fn period_s(&self) -> f64 {
        let n = self.trace.requests.len() as f64;
        let span = self.trace.span_s();
        span + if n > 1.0 { span / (n - 1.0) } else { 1.0 }
    }

    /// Seconds a probe at `scale` lasts.
    pub fn probe_seconds(&self, scale: f64) -> f64 {
        self.window_s
            .unwrap_or_else(|| self.period_s() / scale.max(1e-9))
    }
}
