//! Bytes per token learnt from the upstream's own counts, for a governor
//! that can count with neither a tokenizer nor the upstream: it starts
//! from the ratio the sweep measured on English text (the profile's
//! `server_checks.text_bytes_per_token`, else one byte per token, the
//! bound), and each whole answer to a text prompt counted by the estimate
//! adds its prompt bytes over its `usage.prompt_tokens`. The estimate is
//! the 5th percentile of the last [`WINDOW`] ratios (so 95 prompts in 100
//! are over-counted, not under-), never below 1 byte per token, once
//! [`MIN_SAMPLES`] answers have been seen.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Ratios kept.
pub const WINDOW: usize = 1000;
/// Answers seen before the learnt ratio replaces the starting one.
pub const MIN_SAMPLES: usize = 20;
/// The percentile of the ratios taken: a low one, so that dense text
/// (digits, code) is rarely under-counted.
const PERCENTILE: f64 = 0.05;

#[derive(Debug)]
pub struct LearntEstimate {
    /// The ratio in use, as f64 bits (read on every count).
    current: AtomicU64,
    ratios: Mutex<VecDeque<f64>>,
}

impl LearntEstimate {
    /// Starting from `start` bytes per token (at least 1).
    pub fn new(start: f64) -> LearntEstimate {
        let start = if start.is_finite() {
            start.max(1.0)
        } else {
            1.0
        };
        LearntEstimate {
            current: AtomicU64::new(start.to_bits()),
            ratios: Mutex::new(VecDeque::with_capacity(WINDOW)),
        }
    }

    /// The bytes per token to estimate with now.
    pub fn bytes_per_token(&self) -> f64 {
        f64::from_bits(self.current.load(Ordering::Relaxed))
    }

    /// One answered prompt: `bytes` of text that the upstream counted as
    /// `tokens`.
    pub fn observe(&self, bytes: usize, tokens: u64) {
        if bytes == 0 || tokens == 0 {
            return;
        }
        let mut ratios = self.ratios.lock().unwrap_or_else(|e| e.into_inner());
        if ratios.len() == WINDOW {
            ratios.pop_front();
        }
        ratios.push_back(bytes as f64 / tokens as f64);
        if ratios.len() < MIN_SAMPLES {
            return;
        }
        let mut all: Vec<f64> = ratios.iter().copied().collect();
        let low = envelope_profile::stats::nearest_rank(&mut all, PERCENTILE).unwrap_or(1.0);
        self.current
            .store(low.max(1.0).to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_from_the_profile_and_learns_the_low_end() {
        let e = LearntEstimate::new(4.5);
        assert_eq!(e.bytes_per_token(), 4.5);
        // Below the minimum count the start holds.
        for _ in 0..MIN_SAMPLES - 1 {
            e.observe(400, 100);
        }
        assert_eq!(e.bytes_per_token(), 4.5);
        e.observe(400, 100);
        assert_eq!(e.bytes_per_token(), 4.0);
        // 5% of the prompts dense (2 bytes a token): the estimate follows
        // them, so they are not under-counted.
        for i in 0..200 {
            e.observe(400, if i % 10 == 0 { 200 } else { 100 });
        }
        assert_eq!(e.bytes_per_token(), 2.0);
        // Never below one byte a token (the bound), however the upstream counts.
        for _ in 0..WINDOW {
            e.observe(100, 1000);
        }
        assert_eq!(e.bytes_per_token(), 1.0);
        assert_eq!(LearntEstimate::new(0.2).bytes_per_token(), 1.0);
        assert_eq!(LearntEstimate::new(f64::NAN).bytes_per_token(), 1.0);
    }

    #[test]
    fn the_window_forgets_old_answers() {
        let e = LearntEstimate::new(1.0);
        for _ in 0..WINDOW {
            e.observe(100, 100);
        }
        assert_eq!(e.bytes_per_token(), 1.0);
        for _ in 0..WINDOW {
            e.observe(500, 100);
        }
        assert_eq!(e.bytes_per_token(), 5.0);
    }
}
