//! The validated agent-load settings of `[load]` (`load.workload` and its
//! arrival and scale fields); the load itself is [`crate::agents`].

use super::LoadConfig;
use envelope_profile::workload::Workload;

/// How runs arrive over a probe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Exponential gaps at the class's rate.
    Poisson,
    /// Poisson at `(on + off) / on` times the rate during `on_s`, nothing
    /// during `off_s`: the same mean, in bursts.
    Bursts { on_s: f64, off_s: f64 },
    /// The rate rising linearly from 0 to twice the mean over the probe.
    Ramp,
}

impl Arrival {
    pub fn label(&self) -> &'static str {
        match self {
            Arrival::Poisson => "poisson",
            Arrival::Bursts { .. } => "bursts",
            Arrival::Ramp => "ramp",
        }
    }

    /// The rate at `t_s` relative to the mean, and its most over the probe.
    pub(crate) fn factor(&self, t_s: f64, duration_s: f64) -> (f64, f64) {
        match *self {
            Arrival::Poisson => (1.0, 1.0),
            Arrival::Bursts { on_s, off_s } => {
                let peak = (on_s + off_s) / on_s;
                let on = t_s % (on_s + off_s) < on_s;
                (if on { peak } else { 0.0 }, peak)
            }
            Arrival::Ramp => (2.0 * t_s / duration_s.max(1e-9), 2.0),
        }
    }
}

/// The validated agent-load settings of `[load]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentLoad {
    pub workload: Workload,
    pub arrival: Arrival,
    /// The searched scales are multiples of `scale_step` in [min, max].
    pub scale_min: f64,
    pub scale_step: f64,
    pub scale_max: f64,
    pub duration_s: f64,
    /// Past the first breach: probes at twice the scale each, at most this
    /// many, until goodput falls below `collapse_fraction` of its peak.
    pub collapse_probes: u32,
    pub collapse_fraction: f64,
    /// Seconds at the safe scale after the overload.
    pub recovery_s: f64,
    /// A probe lasts long enough for this many runs on average
    /// (`load.min_requests`), however low the scale.
    pub min_runs: u32,
}

impl AgentLoad {
    /// `None` without `load.workload`; errors name the field.
    pub fn from_load(l: &LoadConfig) -> Result<Option<AgentLoad>, String> {
        let Some(path) = &l.workload else {
            return Ok(None);
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("load.workload: {path}: {e}"))?;
        let workload =
            Workload::from_toml(&text, path).map_err(|e| format!("load.workload: {e}"))?;
        let arrival = match l.arrival.as_str() {
            "poisson" => Arrival::Poisson,
            "ramp" => Arrival::Ramp,
            "bursts" => {
                if !(l.burst_on_s > 0.0 && l.burst_off_s >= 0.0) {
                    return Err(format!(
                        "load.burst_on_s ({}) must be > 0 and load.burst_off_s ({}) >= 0",
                        l.burst_on_s, l.burst_off_s
                    ));
                }
                Arrival::Bursts {
                    on_s: l.burst_on_s,
                    off_s: l.burst_off_s,
                }
            }
            other => {
                return Err(format!(
                    "load.arrival `{other}` is not one of poisson, bursts, ramp"
                ))
            }
        };
        let ok = |v: f64| v.is_finite() && v > 0.0;
        if !(ok(l.scale_step) && ok(l.scale_min) && l.scale_max >= l.scale_min) {
            return Err(format!(
                "load.scale_step ({}) and load.scale_min ({}) must be > 0 and load.scale_max ({}) at least scale_min",
                l.scale_step, l.scale_min, l.scale_max
            ));
        }
        if !(l.collapse_fraction > 0.0 && l.collapse_fraction < 1.0) {
            return Err(format!(
                "load.collapse_fraction must be in (0, 1), got {}",
                l.collapse_fraction
            ));
        }
        let recovery_s = l.recovery_s.unwrap_or(2.0 * l.duration_s);
        if !ok(recovery_s) {
            return Err(format!("load.recovery_s must be > 0, got {recovery_s}"));
        }
        if workload.classes.iter().all(|c| c.runs_per_min <= 0.0) {
            return Err("load.workload: every class has runs_per_min = 0".into());
        }
        Ok(Some(AgentLoad {
            workload,
            arrival,
            scale_min: l.scale_min,
            scale_step: l.scale_step,
            scale_max: l.scale_max,
            duration_s: l.duration_s,
            collapse_probes: l.collapse_probes,
            collapse_fraction: l.collapse_fraction,
            recovery_s,
            min_runs: l.min_requests,
        }))
    }

    /// The searched ladder: scale = k x scale_step for k in the range.
    pub fn ladder(&self) -> (u32, u32) {
        let lo = ((self.scale_min / self.scale_step).ceil() as u32).max(1);
        let hi = ((self.scale_max / self.scale_step).floor() as u32).max(lo);
        (lo, hi)
    }
}
