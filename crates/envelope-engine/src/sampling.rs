//! Turning logits into the next token: greedy, or temperature / top-k /
//! top-p with a per-request seeded RNG (so a seeded request is reproducible
//! whatever else is in the batch, on a given device: a GPU runner picks
//! tokens by [`DevicePick`], the CPU by [`Sampler::sample`]).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }
}

pub struct Sampler {
    rng: StdRng,
}

/// One row's token choice as a device makes it (`kernels/sampling.cu`'s
/// `sample`): greedy when `temperature <= 0`, else top-p over
/// `softmax(logits / temperature)` at the uniform draw `u`, by a threshold
/// bisection instead of a sort. No top-k: a step with a top-k request
/// samples on the host. Tokens follow the same distribution as
/// [`Sampler::sample`]'s but are not the same draws, so a seed reproduces a
/// completion on the same device, not across devices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DevicePick {
    pub temperature: f32,
    pub top_p: f32,
    pub u: f32,
}

impl DevicePick {
    pub const GREEDY: DevicePick = DevicePick {
        temperature: 0.0,
        top_p: 1.0,
        u: 0.0,
    };

    /// Whether a device can pick for `p` (no top-k cut below `vocab`).
    pub fn supports(p: &SamplingParams, vocab: usize) -> bool {
        p.temperature <= 0.0 || p.top_k == 0 || p.top_k >= vocab
    }

    /// The CPU reference of the device's choice.
    pub fn pick(&self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 {
            argmax(logits)
        } else {
            envelope_cuda::reference::top_p_sample(logits, self.temperature, self.top_p, self.u)
                .token
        }
    }
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Sampler {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler { rng }
    }

    /// The device's pick for this sequence's next token: greedy, or top-p
    /// with the next draw of this sequence's generator.
    pub fn device_pick(&mut self, p: &SamplingParams) -> DevicePick {
        if p.temperature <= 0.0 {
            return DevicePick::GREEDY;
        }
        DevicePick {
            temperature: p.temperature,
            top_p: p.top_p,
            u: self.rng.random::<f32>(),
        }
    }

    pub fn sample(&mut self, logits: &[f32], p: &SamplingParams) -> u32 {
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let inv_t = 1.0 / p.temperature;
        let mut keep = idx.len();
        if p.top_k > 0 && p.top_k < keep {
            idx.select_nth_unstable_by(p.top_k - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            keep = p.top_k;
            idx.truncate(keep);
        }
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) * inv_t).exp())
            .collect();
        let z: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= z);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut cut = probs.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p {
                    cut = i + 1;
                    break;
                }
            }
            probs.truncate(cut);
        }
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, pr) in probs.iter().enumerate() {
            r -= pr;
            if r <= 0.0 {
                return idx[i];
            }
        }
        idx[probs.len() - 1]
    }
}

/// Index of the largest logit; the lowest index wins a tie. One definition
/// for the host sampler and the reference the GPU's `argmax` kernel is
/// checked against, so greedy decoding picks the same token on both.
pub use envelope_cuda::reference::argmax;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_the_max() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(Some(1));
        assert_eq!(s.sample(&[0.0, 1.0, 5.0], &SamplingParams::greedy(1)), 2);
    }

    /// The device's top-p (threshold bisection, index-order walk) draws from
    /// the same distribution as the host's sort-based sampler.
    #[test]
    fn device_picks_follow_the_host_samplers_distribution() {
        let logits = [2.0f32, 0.5, 1.5, -1.0, 1.0, 0.0, 2.5, -0.5];
        for (t, p) in [(1.0f32, 1.0f32), (0.7, 0.9), (1.5, 0.6)] {
            let params = SamplingParams {
                temperature: t,
                top_p: p,
                ..Default::default()
            };
            let n = 40_000;
            let (mut host, mut dev) = (vec![0f64; 8], vec![0f64; 8]);
            let mut s = Sampler::new(Some(11));
            let mut d = Sampler::new(Some(12));
            for _ in 0..n {
                host[s.sample(&logits, &params) as usize] += 1.0 / n as f64;
                dev[d.device_pick(&params).pick(&logits) as usize] += 1.0 / n as f64;
            }
            for i in 0..8 {
                assert!(
                    (host[i] - dev[i]).abs() < 0.015,
                    "T {t} p {p} token {i}: host {:.3} device {:.3}",
                    host[i],
                    dev[i]
                );
            }
            // The nucleus cut is the same set: tokens outside it never come.
            for i in 0..8 {
                assert_eq!(host[i] == 0.0, dev[i] == 0.0, "T {t} p {p} token {i}");
            }
        }
        assert_eq!(
            Sampler::new(None).device_pick(&SamplingParams::greedy(1)),
            DevicePick::GREEDY
        );
        let top_k = SamplingParams {
            top_k: 5,
            ..Default::default()
        };
        assert!(!DevicePick::supports(&top_k, 100));
        assert!(DevicePick::supports(&top_k, 5));
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_p() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let p = SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(42),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(Some(42));
            (0..50).map(|_| s.sample(&logits, &p)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(Some(42));
            (0..50).map(|_| s.sample(&logits, &p)).collect()
        };
        assert_eq!(a, b);
        // top_p = tiny keeps only the best token.
        let p1 = SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            ..Default::default()
        };
        let mut s = Sampler::new(Some(3));
        for _ in 0..20 {
            assert_eq!(s.sample(&logits, &p1), argmax(&logits));
        }
        // top_k = 2 never picks outside the best two.
        let pk = SamplingParams {
            temperature: 5.0,
            top_k: 2,
            ..Default::default()
        };
        let mut sorted: Vec<u32> = (0..100).collect();
        sorted.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        for _ in 0..50 {
            let t = s.sample(&logits, &pk);
            assert!(t == sorted[0] || t == sorted[1]);
        }
    }
}
