//! The latency guard: feedback below the measured ceiling. The governor
//! times what it proxies (time to first token and mean inter-token gap of a
//! stream, whole time of a non-streaming answer) over a sliding window; when
//! their p95 breaks the profile's SLOs it lowers the share of the envelope
//! it admits, and it raises it again, a step at a time, once they are
//! clear by a margin (hysteresis). Never above the profile's ceiling.
//!
//! The controller is a gradient one in the manner of Envoy's adaptive
//! concurrency filter and Netflix's concurrency-limits (Gradient2): on a
//! breach the limit is multiplied by `slo / observed` (at most halved, at
//! least cut by a tenth); recovery is additive. Unlike them it needs no
//! probe for a minimum RTT: the SLOs and the profile's measured ceiling are
//! the reference. Only requests admitted after the last change are judged,
//! so one slow spell is not punished twice. Plain data, times passed in.

use envelope_profile::Slo;
use std::collections::VecDeque;

#[derive(Debug, Clone, PartialEq)]
pub struct LatencySettings {
    pub enabled: bool,
    pub ttft_slo_ms: Option<f64>,
    pub itl_slo_ms: Option<f64>,
    /// Non-streaming answers: their whole time against the e2e SLO.
    pub e2e_slo_ms: Option<f64>,
    /// Samples older than this are forgotten.
    pub window_ms: u64,
    /// Completed requests (admitted since the last change) needed to judge.
    pub min_samples: usize,
    /// Least time between two decisions.
    pub min_interval_ms: u64,
    /// The p95 the guard aims at, as a fraction of each SLO: a breach is
    /// p95 over `target x SLO`, so it settles under the SLO, not on it
    /// (Envoy's gradient keeps a buffer over its minimum RTT the same way).
    pub target: f64,
    /// p95 / (target x SLO) under this counts towards recovery.
    pub recover_ratio: f64,
    /// Consecutive clear judgements before one step up.
    pub recover_judgements: u32,
    /// One step up, as a fraction of the ceiling.
    pub recover_step: f64,
}

impl Default for LatencySettings {
    fn default() -> Self {
        LatencySettings {
            enabled: true,
            ttft_slo_ms: None,
            itl_slo_ms: None,
            e2e_slo_ms: None,
            window_ms: 10_000,
            min_samples: 6,
            min_interval_ms: 500,
            target: 0.9,
            recover_ratio: 0.8,
            recover_judgements: 2,
            recover_step: 0.1,
        }
    }
}

impl LatencySettings {
    /// Guards the profile's TTFT, ITL and e2e SLOs.
    pub fn from_slo(slo: &Slo) -> LatencySettings {
        LatencySettings {
            ttft_slo_ms: slo.ttft_p95_ms,
            itl_slo_ms: slo.itl_p95_ms,
            e2e_slo_ms: slo.e2e_p99_ms,
            ..LatencySettings::default()
        }
    }

    /// Whether there is anything to guard.
    pub fn active(&self) -> bool {
        self.enabled
            && (self.ttft_slo_ms.is_some()
                || self.itl_slo_ms.is_some()
                || self.e2e_slo_ms.is_some())
    }

    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("ttft_p95_ms", self.ttft_slo_ms),
            ("itl_p95_ms", self.itl_slo_ms),
            ("e2e_p99_ms", self.e2e_slo_ms),
        ] {
            if v.is_some_and(|v| v.is_nan() || v <= 0.0) {
                return Err(format!("latency guard: SLO `{name}` must be positive"));
            }
        }
        if !(self.target > 0.0 && self.target <= 1.0) {
            return Err("latency guard: `target` must be in (0, 1]".into());
        }
        if !(self.recover_ratio > 0.0 && self.recover_ratio < 1.0) {
            return Err("latency guard: `recover_ratio` must be in (0, 1)".into());
        }
        if !(self.recover_step > 0.0 && self.recover_step <= 1.0) {
            return Err("latency guard: `recover_step` must be in (0, 1]".into());
        }
        if self.min_samples == 0 || self.window_ms == 0 {
            return Err("latency guard: `min_samples` and `window_ms` must be at least 1".into());
        }
        Ok(())
    }
}

/// One completed request as the proxy timed it (from its upstream send).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sample {
    /// When it was admitted (ms on the governor's clock).
    pub admitted_ms: u64,
    /// When it completed.
    pub done_ms: u64,
    /// Streams: to the first chunk.
    pub ttft_ms: Option<f64>,
    /// Streams: mean gap between events after the first.
    pub itl_ms: Option<f64>,
    /// Non-streaming answers: the whole time.
    pub e2e_ms: Option<f64>,
}

/// p95s over the judged window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Observed {
    pub samples: usize,
    pub ttft_p95_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    pub e2e_p95_ms: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct LatencyGuard {
    cfg: LatencySettings,
    samples: VecDeque<Sample>,
    /// Share of the profile's ceiling admitted now, in (floor, 1].
    fraction: f64,
    floor: f64,
    last_change_ms: u64,
    last_judged_ms: Option<u64>,
    clear_streak: u32,
    /// Why the share is what it is: `slo_met`, `ttft_p95`, `itl_p95`,
    /// `e2e_p95`, `recovering`, or `off`.
    pub cause: &'static str,
    pub last: Observed,
    /// When `last` was taken.
    last_at_ms: u64,
}

fn p95(mut v: Vec<f64>) -> Option<f64> {
    envelope_profile::stats::nearest_rank(&mut v, 0.95)
}

const MAX_SAMPLES: usize = 8192;

/// One recovery step, snapped to 1 so sums of tenths reach it.
fn step_up(fraction: f64, step: f64) -> f64 {
    let f = fraction + step;
    if f >= 1.0 - 1e-9 {
        1.0
    } else {
        f
    }
}

impl LatencyGuard {
    /// `floor`: the least share it may lower to (one sequence of the most
    /// expensive bucket, so every shape the profile admits can still run).
    pub fn new(cfg: LatencySettings, floor: f64) -> LatencyGuard {
        let cause = if cfg.active() { "slo_met" } else { "off" };
        LatencyGuard {
            cfg,
            samples: VecDeque::new(),
            fraction: 1.0,
            floor: floor.clamp(0.0, 1.0),
            last_change_ms: 0,
            last_judged_ms: None,
            clear_streak: 0,
            cause,
            last: Observed::default(),
            last_at_ms: 0,
        }
    }

    pub fn config(&self) -> &LatencySettings {
        &self.cfg
    }

    /// The share of the ceiling admitted now.
    pub fn fraction(&self) -> f64 {
        self.fraction
    }

    pub fn floor(&self) -> f64 {
        self.floor
    }

    /// The TTFT p95 last judged, if it is recent (within the window).
    pub fn recent_ttft_p95_ms(&self, now_ms: u64) -> Option<f64> {
        (now_ms.saturating_sub(self.last_at_ms) <= self.cfg.window_ms)
            .then_some(self.last.ttft_p95_ms)
            .flatten()
    }

    /// Time passing with too little traffic to judge: once a whole window
    /// has gone by since the last change without enough samples, the share
    /// climbs a step (a throttled node that is no longer busy must not stay
    /// throttled). Returns the new share when it changed.
    pub fn tick(&mut self, now_ms: u64) -> Option<f64> {
        if !self.cfg.active() || self.fraction >= 1.0 {
            return None;
        }
        if now_ms.saturating_sub(self.last_change_ms) < self.cfg.window_ms {
            return None;
        }
        if self.observe(now_ms).samples >= self.cfg.min_samples {
            return None;
        }
        self.fraction = step_up(self.fraction, self.cfg.recover_step);
        self.cause = if self.fraction >= 1.0 {
            "slo_met"
        } else {
            "recovering"
        };
        self.last_change_ms = now_ms;
        Some(self.fraction)
    }

    /// Records a completed request and judges; returns the new share when
    /// it changed.
    pub fn record(&mut self, s: Sample) -> Option<f64> {
        if !self.cfg.active() {
            return None;
        }
        if self.samples.len() >= MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(s);
        self.judge(s.done_ms)
    }

    /// What the judged samples show now.
    pub fn observe(&mut self, now_ms: u64) -> Observed {
        let window = self.cfg.window_ms;
        while let Some(f) = self.samples.front() {
            if now_ms.saturating_sub(f.done_ms) > window {
                self.samples.pop_front();
            } else {
                break;
            }
        }
        let judged: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.admitted_ms >= self.last_change_ms)
            .collect();
        Observed {
            samples: judged.len(),
            ttft_p95_ms: p95(judged.iter().filter_map(|s| s.ttft_ms).collect()),
            itl_p95_ms: p95(judged.iter().filter_map(|s| s.itl_ms).collect()),
            e2e_p95_ms: p95(judged.iter().filter_map(|s| s.e2e_ms).collect()),
        }
    }

    fn judge(&mut self, now_ms: u64) -> Option<f64> {
        if self
            .last_judged_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < self.cfg.min_interval_ms)
        {
            return None;
        }
        let o = self.observe(now_ms);
        self.last = o;
        self.last_at_ms = now_ms;
        if o.samples < self.cfg.min_samples {
            return None;
        }
        self.last_judged_ms = Some(now_ms);
        // The worst signal, as observed / SLO.
        let mut worst: Option<(f64, &'static str)> = None;
        for (obs, slo, why) in [
            (o.ttft_p95_ms, self.cfg.ttft_slo_ms, "ttft_p95"),
            (o.itl_p95_ms, self.cfg.itl_slo_ms, "itl_p95"),
            (o.e2e_p95_ms, self.cfg.e2e_slo_ms, "e2e_p95"),
        ] {
            if let (Some(obs), Some(slo)) = (obs, slo) {
                let r = obs / (slo * self.cfg.target);
                if worst.is_none_or(|w| r > w.0) {
                    worst = Some((r, why));
                }
            }
        }
        let (ratio, why) = worst?;
        let before = self.fraction;
        if ratio > 1.0 {
            self.clear_streak = 0;
            let g = (1.0 / ratio).clamp(0.5, 0.9);
            self.fraction = (self.fraction * g).max(self.floor);
            self.cause = why;
        } else if ratio < self.cfg.recover_ratio {
            self.clear_streak += 1;
            if self.fraction < 1.0 && self.clear_streak >= self.cfg.recover_judgements {
                self.clear_streak = 0;
                self.fraction = step_up(self.fraction, self.cfg.recover_step);
                self.cause = if self.fraction >= 1.0 {
                    "slo_met"
                } else {
                    "recovering"
                };
            }
        } else {
            self.clear_streak = 0;
        }
        if self.fraction != before {
            self.last_change_ms = now_ms;
            Some(self.fraction)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> LatencyGuard {
        let cfg = LatencySettings {
            ttft_slo_ms: Some(1000.0),
            itl_slo_ms: Some(100.0),
            ..LatencySettings::default()
        };
        LatencyGuard::new(cfg, 0.25)
    }

    fn stream(at: u64, ttft: f64, itl: f64) -> Sample {
        Sample {
            admitted_ms: at,
            done_ms: at + 10,
            ttft_ms: Some(ttft),
            itl_ms: Some(itl),
            e2e_ms: None,
        }
    }

    /// Feeds `n` requests admitted from `t` on, one every 100 ms.
    fn feed(g: &mut LatencyGuard, t: &mut u64, n: usize, ttft: f64, itl: f64) -> Vec<f64> {
        let mut changes = vec![];
        for _ in 0..n {
            *t += 100;
            if let Some(f) = g.record(stream(*t, ttft, itl)) {
                changes.push(f);
            }
        }
        changes
    }

    #[test]
    fn a_breach_lowers_the_share_by_the_gradient_and_never_under_the_floor() {
        let mut g = guard();
        let mut t = 0;
        // Inside the SLOs: nothing moves.
        assert!(feed(&mut g, &mut t, 20, 500.0, 50.0).is_empty());
        assert_eq!(g.fraction(), 1.0);
        // ITL at 1.25x its target (0.9 x the SLO): cut to 0.8 (1 / 1.25),
        // cause named.
        let ch = feed(&mut g, &mut t, 8, 500.0, 112.5);
        assert_eq!(ch.len(), 1, "{ch:?}");
        assert!((g.fraction() - 0.8).abs() < 1e-9);
        assert_eq!(g.cause, "itl_p95");
        // Way over: at most halved per judgement, never under the floor.
        feed(&mut g, &mut t, 40, 10_000.0, 50.0);
        assert_eq!(g.fraction(), 0.25);
        assert_eq!(g.cause, "ttft_p95");
    }

    #[test]
    fn only_requests_admitted_after_a_change_are_judged() {
        let mut g = guard();
        let mut t = 0;
        feed(&mut g, &mut t, 6, 2000.0, 50.0);
        assert!((g.fraction() - 0.5).abs() < 1e-9);
        // Slow requests admitted before the change complete later: they do
        // not cut again.
        for i in 0..10 {
            let s = Sample {
                admitted_ms: t - 500,
                done_ms: t + 100 * i,
                ttft_ms: Some(3000.0),
                itl_ms: None,
                e2e_ms: None,
            };
            assert_eq!(g.record(s), None);
        }
        assert!((g.fraction() - 0.5).abs() < 1e-9);
    }

    #[test]
    fn recovery_is_stepwise_with_hysteresis() {
        let mut g = guard();
        let mut t = 0;
        feed(&mut g, &mut t, 6, 2000.0, 50.0);
        assert!((g.fraction() - 0.5).abs() < 1e-9);
        // At its target (0.9 of the SLO): held, neither cut nor raised.
        feed(&mut g, &mut t, 60, 900.0, 50.0);
        assert!((g.fraction() - 0.5).abs() < 1e-9);
        // Clear by the margin: up a step per two clear judgements, to 1.
        let ch = feed(&mut g, &mut t, 200, 300.0, 30.0);
        assert!(ch.len() >= 5, "{ch:?}");
        assert!(ch.windows(2).all(|w| w[1] > w[0]), "{ch:?}");
        assert_eq!(g.fraction(), 1.0);
        assert_eq!(g.cause, "slo_met");
    }

    #[test]
    fn with_too_little_traffic_to_judge_it_climbs_back_in_time() {
        let mut g = guard();
        let mut t = 0;
        feed(&mut g, &mut t, 6, 2000.0, 50.0);
        assert!((g.fraction() - 0.5).abs() < 1e-9);
        assert_eq!(g.recent_ttft_p95_ms(t), Some(2000.0));
        // Within the window: nothing yet.
        assert_eq!(g.tick(t + 5_000), None);
        // A quiet window: a step per window, to 1.
        let mut f = vec![];
        for w in 1..=6 {
            if let Some(x) = g.tick(t + 10_001 * w) {
                f.push(x);
            }
        }
        assert_eq!(f.len(), 5, "{f:?}");
        assert_eq!(g.fraction(), 1.0);
        // The last judged TTFT is forgotten once it is old.
        assert_eq!(g.recent_ttft_p95_ms(t + 60_000), None);
    }

    #[test]
    fn without_slos_or_samples_it_does_nothing() {
        let mut g = LatencyGuard::new(LatencySettings::default(), 0.1);
        assert_eq!(g.cause, "off");
        let mut t = 0;
        assert!(feed(&mut g, &mut t, 50, 1e9, 1e9).is_empty());
        // Too few samples to judge.
        let mut g = guard();
        assert!(feed(&mut g, &mut t, 5, 1e9, 1e9).is_empty());
        assert_eq!(p95(vec![]), None);
        assert_eq!(p95((1..=100).map(f64::from).collect()), Some(95.0));
        // In any order.
        assert_eq!(p95((1..=100).rev().map(f64::from).collect()), Some(95.0));
        let mixed = (0..100).map(|i| f64::from((i * 37) % 100 + 1)).collect();
        assert_eq!(p95(mixed), Some(95.0));
        assert_eq!(p95(vec![7.0]), Some(7.0));
    }
}
