//! How fast reservations drain, measured from completed requests, and what
//! follows from it: the estimated wait for a queued request and the
//! `Retry-After` for a refused one. Plain data with times passed in.
//!
//! `Retry-After` is whole seconds clamped to 1..=60 because the official
//! OpenAI clients honour it only when 0 < value <= 60 s.

use std::collections::VecDeque;

#[derive(Debug, Clone)]
pub struct DrainEstimator {
    window_ms: u64,
    /// (release time ms, KV tokens released)
    events: VecDeque<(u64, u64)>,
    /// Exponentially weighted mean service time of admitted requests, ms.
    service_ms: Option<f64>,
}

pub const RETRY_AFTER_MIN_S: u64 = 1;
pub const RETRY_AFTER_MAX_S: u64 = 60;

impl DrainEstimator {
    pub fn new(window_ms: u64) -> DrainEstimator {
        DrainEstimator {
            window_ms: window_ms.max(1),
            events: VecDeque::new(),
            service_ms: None,
        }
    }

    fn trim(&mut self, now_ms: u64) {
        while let Some(&(t, _)) = self.events.front() {
            if now_ms.saturating_sub(t) > self.window_ms {
                self.events.pop_front();
            } else {
                break;
            }
        }
    }

    /// A reservation of `kv_tokens` came back after `service_ms`.
    pub fn record(&mut self, now_ms: u64, kv_tokens: u64, service_ms: u64) {
        self.trim(now_ms);
        self.events.push_back((now_ms, kv_tokens));
        let s = service_ms as f64;
        self.service_ms = Some(match self.service_ms {
            None => s,
            Some(m) => 0.8 * m + 0.2 * s,
        });
    }

    /// KV tokens released per second over the window; `None` before any
    /// release (the governor then knows nothing and says so).
    pub fn rate_tokens_per_s(&mut self, now_ms: u64) -> Option<f64> {
        self.trim(now_ms);
        let first = self.events.front()?.0;
        let total: u64 = self.events.iter().map(|e| e.1).sum();
        // Over the span actually observed, but at least a second, so one
        // early release does not read as an enormous rate.
        let span_ms = now_ms.saturating_sub(first).max(1000);
        Some(total as f64 * 1000.0 / span_ms as f64)
    }

    pub fn service_ms(&self) -> Option<f64> {
        self.service_ms
    }

    /// Time until `excess_tokens` more KV tokens are free, in ms. The rate
    /// is the larger of the measured one and `capacity_tokens` per mean
    /// service time (what a full node drains), so a short history right
    /// after start cannot make the wait look hopeless.
    pub fn wait_ms(
        &mut self,
        now_ms: u64,
        excess_tokens: u64,
        capacity_tokens: u64,
    ) -> Option<f64> {
        if excess_tokens == 0 {
            return Some(0.0);
        }
        let measured = self.rate_tokens_per_s(now_ms);
        let full = self
            .service_ms
            .filter(|&s| s > 0.0)
            .map(|s| capacity_tokens as f64 * 1000.0 / s);
        let rate = match (measured, full) {
            (Some(a), Some(b)) => a.max(b),
            (a, b) => a.or(b)?,
        };
        if rate <= 0.0 {
            return None;
        }
        Some(excess_tokens as f64 * 1000.0 / rate)
    }

    /// Whole seconds to wait before retrying, 1..=60.
    pub fn retry_after_s(&mut self, now_ms: u64, excess_tokens: u64, capacity_tokens: u64) -> u64 {
        let wait_ms = self
            .wait_ms(now_ms, excess_tokens, capacity_tokens)
            .or(self.service_ms)
            .unwrap_or(1000.0);
        retry_after_from_ms(wait_ms)
    }
}

/// Rounds a wait up to whole seconds within 1..=60.
pub fn retry_after_from_ms(wait_ms: f64) -> u64 {
    if !wait_ms.is_finite() {
        return RETRY_AFTER_MAX_S;
    }
    ((wait_ms / 1000.0).ceil() as u64).clamp(RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_over_the_window() {
        let mut d = DrainEstimator::new(10_000);
        assert_eq!(d.rate_tokens_per_s(0), None);
        for i in 0..10 {
            d.record(i * 1000, 100, 500);
        }
        // 1000 tokens over 9 s.
        let r = d.rate_tokens_per_s(9_000).unwrap();
        assert!((r - 111.1).abs() < 0.5, "{r}");
        // Old events fall out of the window.
        let r = d.rate_tokens_per_s(19_000).unwrap();
        assert!((r - 10.0).abs() < 0.01, "{r}");
        assert_eq!(d.rate_tokens_per_s(100_000), None);
    }

    #[test]
    fn one_release_is_spread_over_at_least_a_second() {
        let mut d = DrainEstimator::new(10_000);
        d.record(5, 1000, 10);
        assert_eq!(d.rate_tokens_per_s(5), Some(1000.0));
    }

    #[test]
    fn retry_after_follows_the_drain_rate_and_is_clamped() {
        let mut d = DrainEstimator::new(10_000);
        for i in 0..=10 {
            d.record(i * 1000, 100, 500);
        }
        // ~100 tokens/s: 250 excess -> 3 s; tiny -> 1; huge -> 60.
        assert_eq!(d.retry_after_s(10_000, 250, 0), 3);
        assert_eq!(d.retry_after_s(10_000, 1, 0), 1);
        assert_eq!(d.retry_after_s(10_000, 0, 0), 1);
        assert_eq!(d.retry_after_s(10_000, 1_000_000, 0), 60);
        // A full node of 1000 tokens with 0.5 s service drains 2000/s.
        assert_eq!(d.wait_ms(10_000, 1000, 1000), Some(500.0));
        assert_eq!(retry_after_from_ms(f64::INFINITY), 60);
        assert_eq!(retry_after_from_ms(0.0), 1);
        assert_eq!(retry_after_from_ms(1000.1), 2);
    }

    #[test]
    fn without_measurements_falls_back_to_service_time_then_one_second() {
        let mut d = DrainEstimator::new(1_000);
        assert_eq!(d.retry_after_s(0, 500, 0), 1);
        d.record(0, 10, 4_500);
        // The window has passed: no rate; a service time of 4.5 s.
        assert_eq!(d.retry_after_s(50_000, 500, 0), 5);
        assert_eq!(d.wait_ms(50_000, 500, 0), None);
        assert_eq!(d.wait_ms(50_000, 0, 0), Some(0.0));
        // 500 tokens of a 100-token node: five service times.
        assert_eq!(d.wait_ms(50_000, 500, 100), Some(22_500.0));
    }

    #[test]
    fn service_time_is_smoothed() {
        let mut d = DrainEstimator::new(1_000);
        d.record(0, 1, 1000);
        d.record(1, 1, 2000);
        assert!((d.service_ms().unwrap() - 1200.0).abs() < 1e-9);
    }
}
