//! The Llama-family forward pass over a batch of sequence chunks. Every
//! linear layer sees all the step's tokens at once (one batched matmul);
//! attention reads each sequence's own KV blocks.

use crate::attention::{paged_attention, write_kv, TokenSlot};
use crate::config::{ModelConfig, RopeStyle};
use crate::error::Result;
use crate::kv_cache::{KvElem, KvGeometry, KvPool, KvStorage, LayerKv};
use crate::weights::ModelWeights;
use candle_core::{Device, Tensor, D};

/// One sequence's share of a step: `tokens` at positions
/// `start_pos..start_pos + tokens.len()`, whose K/V go into `block_table`.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    /// Return logits for the chunk's last token.
    pub want_logits: bool,
}

pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    inv_freq: Vec<f32>,
}

impl Model {
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Model {
        let hd = config.head_dim;
        // Same f32 arithmetic as candle-transformers' llama.
        let inv_freq = (0..hd)
            .step_by(2)
            .map(|i| 1f32 / config.rope_theta.powf(i as f32 / hd as f32))
            .collect();
        Model {
            config,
            weights,
            inv_freq,
        }
    }

    fn rope_tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &self.inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }

    fn apply_rope(&self, x: &mut [f32], heads: usize, cos: &[f32], sin: &[f32]) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        for (t, tok) in x.chunks_mut(heads * hd).enumerate() {
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for head in tok.chunks_mut(hd) {
                match self.config.rope_style {
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (head[2 * i], head[2 * i + 1]);
                            head[2 * i] = a * c[i] - b * s[i];
                            head[2 * i + 1] = a * s[i] + b * c[i];
                        }
                    }
                    RopeStyle::HalfSplit => {
                        for i in 0..half {
                            let (a, b) = (head[i], head[i + half]);
                            head[i] = a * c[i] - b * s[i];
                            head[i + half] = a * s[i] + b * c[i];
                        }
                    }
                }
            }
        }
    }

    /// Runs one step. Returns `[n, vocab]` f32 logits, one row per chunk
    /// with `want_logits`, in chunk order (`None` when no chunk wants them).
    pub fn forward(&self, kv: &mut KvPool, chunks: &[SeqChunk]) -> Result<Option<Tensor>> {
        let cfg = &self.config;
        let mut ids = Vec::new();
        let mut slots = Vec::new();
        let mut positions = Vec::new();
        let mut logit_rows = Vec::new();
        for c in chunks {
            for (i, &t) in c.tokens.iter().enumerate() {
                ids.push(t);
                positions.push(c.start_pos + i);
                slots.push(TokenSlot {
                    block_table: c.block_table,
                    pos: c.start_pos + i,
                });
            }
            if c.want_logits && !c.tokens.is_empty() {
                logit_rows.push(ids.len() as u32 - 1);
            }
        }
        if ids.is_empty() {
            return Ok(None);
        }
        let (cos, sin) = self.rope_tables(&positions);
        let n = ids.len();
        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let geometry = kv.geometry;
        let eps = cfg.rms_norm_eps as f32;
        let mut x = self.weights.embedding.rows(&ids)?;
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let xn = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let mut q = layer.wq.forward(&xn)?.flatten_all()?.to_vec1::<f32>()?;
            let mut k = layer.wk.forward(&xn)?.flatten_all()?.to_vec1::<f32>()?;
            let v = layer.wv.forward(&xn)?.flatten_all()?.to_vec1::<f32>()?;
            self.apply_rope(&mut q, cfg.num_heads, &cos, &sin);
            self.apply_rope(&mut k, cfg.num_kv_heads, &cos, &sin);
            debug_assert_eq!(k.len(), n * kvd);
            let attn = match &mut kv.storage {
                KvStorage::F32(l) => {
                    attend(&geometry, &mut l[li], &slots, &q, &k, &v, cfg.num_heads)
                }
                KvStorage::F16(l) => {
                    attend(&geometry, &mut l[li], &slots, &q, &k, &v, cfg.num_heads)
                }
                KvStorage::Bf16(l) => {
                    attend(&geometry, &mut l[li], &slots, &q, &k, &v, cfg.num_heads)
                }
            };
            let attn = Tensor::from_vec(attn, (n, qd), &Device::Cpu)?;
            x = (layer.wo.forward(&attn)? + x)?;
            let xn = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gate = layer.w_gate.forward(&xn)?;
            let up = layer.w_up.forward(&xn)?;
            let h = (candle_nn::ops::silu(&gate)? * up)?;
            x = (layer.w_down.forward(&h)? + x)?;
        }
        if logit_rows.is_empty() {
            return Ok(None);
        }
        let rows = Tensor::new(logit_rows.as_slice(), &Device::Cpu)?;
        let last = x.index_select(&rows, 0)?;
        let last = candle_nn::ops::rms_norm(&last, &self.weights.final_norm, eps)?;
        let logits = self.weights.lm_head.forward(&last)?;
        debug_assert_eq!(logits.dim(D::Minus1)?, cfg.vocab_size);
        Ok(Some(logits))
    }
}

fn attend<T: KvElem>(
    g: &KvGeometry,
    layer: &mut LayerKv<T>,
    slots: &[TokenSlot],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
) -> Vec<f32> {
    write_kv(g, layer, slots, k, v);
    paged_attention(g, layer, slots, q, heads)
}
