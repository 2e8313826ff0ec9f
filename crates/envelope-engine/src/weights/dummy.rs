//! `dummy:` presets: deterministic random weights, every element a
//! counter-based hash of (seed, tensor name, index), so any backend can
//! make them again without a file (kernels/dummy.cu does on the GPU).

use super::hf::hf_name;
use super::{Role, TensorSource};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::linear::RawWeight;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

/// Deterministic random weights: every element is a counter-based hash of
/// (seed, tensor name, index), so any backend can regenerate them
/// identically without shipping files.
pub(super) struct DummySource {
    pub(super) cfg: ModelConfig,
    pub(super) preset: String,
    pub(super) seed: u64,
}

pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(super) fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The per-tensor key of the dummy generator: element `i` of the tensor is
/// a function of `splitmix64(key ^ i)` only (kernels/dummy.cu computes the
/// same on the GPU).
pub fn dummy_key(seed: u64, name: &str) -> u64 {
    splitmix64(seed ^ fnv1a(name))
}

/// How a `dummy:` preset fills one tensor.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum DummyInit {
    /// Not in the model (a tied LM head, a bias the architecture lacks).
    Absent,
    /// Norm weights: all ones, `[len]`.
    Ones(usize),
    /// Uniform in [-scale, scale), then rounded to bf16.
    Uniform { shape: Vec<usize>, scale: f32 },
}

/// The dummy initialisation of `role`: shapes of the config, scales that
/// keep activations of order one through the layers.
pub(crate) fn dummy_init(c: &ModelConfig, role: Role) -> DummyInit {
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let (shape, scale): (Vec<usize>, f32) = match role {
        Role::Embedding => (vec![c.vocab_size, h], 1.0),
        Role::LmHead if c.tie_word_embeddings => return DummyInit::Absent,
        Role::LmHead => (vec![c.vocab_size, h], 1.0 / (h as f32).sqrt()),
        Role::FinalNorm | Role::AttnNorm | Role::FfnNorm => return DummyInit::Ones(h),
        Role::Q => (vec![q, h], (3.0 / h as f32).sqrt()),
        Role::K | Role::V => (vec![kv, h], (3.0 / h as f32).sqrt()),
        Role::O => (vec![h, q], (3.0 / q as f32).sqrt()),
        Role::QBias | Role::KBias | Role::VBias if !c.attention_bias => return DummyInit::Absent,
        Role::QBias => (vec![q], 0.02),
        Role::KBias | Role::VBias => (vec![kv], 0.02),
        Role::Gate | Role::Up => (vec![f, h], (3.0 / h as f32).sqrt()),
        Role::Down => (vec![h, f], (3.0 / f as f32).sqrt()),
    };
    DummyInit::Uniform { shape, scale }
}

/// Uniform values in [-scale, scale), deterministic in (seed, name, index).
pub fn dummy_values(seed: u64, name: &str, len: usize, scale: f32) -> Vec<f32> {
    let key = dummy_key(seed, name);
    let mut out = vec![0f32; len];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let base = (c << 16) as u64;
            for (i, v) in chunk.iter_mut().enumerate() {
                let h = splitmix64(key ^ (base + i as u64));
                let unit = (h >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                *v = (unit * 2.0 - 1.0) * scale;
            }
        });
    out
}

impl TensorSource for DummySource {
    fn get(&mut self, role: Role, layer: usize) -> Result<Option<RawWeight>> {
        let (shape, scale) = match dummy_init(&self.cfg, role) {
            DummyInit::Absent => return Ok(None),
            DummyInit::Ones(h) => {
                return Ok(Some(RawWeight::Dense(Tensor::ones(
                    h,
                    DType::F32,
                    &Device::Cpu,
                )?)))
            }
            DummyInit::Uniform { shape, scale } => (shape, scale),
        };
        let name = hf_name(role, layer);
        let len = shape.iter().product();
        let values = dummy_values(self.seed, &name, len, scale);
        let t = Tensor::from_vec(values, shape, &Device::Cpu)?;
        // Dummy weights are "stored" as bf16, like the published checkpoints.
        Ok(Some(RawWeight::Dense(t.to_dtype(DType::BF16)?)))
    }
    fn name(&self) -> String {
        format!("dummy:{}@{}", self.preset, self.seed)
    }
}
