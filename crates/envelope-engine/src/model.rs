//! The Llama-family forward pass, written once for every backend: the
//! [`Backend`] trait names the operations a step needs (embedding, RMSNorm,
//! projections, RoPE + paged attention, SwiGLU, the residual adds, the LM
//! head) and [`forward`] strings them together. The CPU backend below runs
//! them with candle and our paged attention; the CUDA backend
//! (`crate::cuda`) runs the same sequence with NVRTC kernels and cuBLAS.
//! Every linear layer sees all the step's tokens at once (one batched
//! matmul); attention reads each sequence's own KV blocks.

use crate::attention::{paged_attention, write_kv, TokenSlot};
use crate::config::{ModelConfig, RopeStyle};
use crate::error::Result;
use crate::kv_cache::{KvElem, KvGeometry, KvPool, KvStorage, LayerKv};
use crate::linear::Linear;
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

/// A step flattened once on the host, shared by every backend: the token
/// ids and positions of all chunks in order, and which rows get logits.
#[derive(Debug, Clone)]
pub struct StepBatch<'a> {
    pub chunks: &'a [SeqChunk<'a>],
    pub ids: Vec<u32>,
    pub positions: Vec<usize>,
    /// Row (index into `ids`) of each chunk's last token, for chunks that want logits.
    pub logit_rows: Vec<u32>,
}

impl<'a> StepBatch<'a> {
    pub fn new(chunks: &'a [SeqChunk<'a>]) -> StepBatch<'a> {
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut logit_rows = Vec::new();
        for c in chunks {
            for (i, &t) in c.tokens.iter().enumerate() {
                ids.push(t);
                positions.push(c.start_pos + i);
            }
            if c.want_logits && !c.tokens.is_empty() {
                logit_rows.push(ids.len() as u32 - 1);
            }
        }
        StepBatch {
            chunks,
            ids,
            positions,
            logit_rows,
        }
    }

    /// Every chunk is one token (a pure decode step).
    pub fn is_decode(&self) -> bool {
        self.chunks.iter().all(|c| c.tokens.len() == 1)
    }
}

/// Which RMSNorm weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    Attn(usize),
    Ffn(usize),
    Final,
}

/// The projections whose output is added to the residual stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proj {
    /// Attention output (`wo`).
    Out,
    /// MLP down projection.
    Down,
}

/// What a backend does for one step. Activations are `[tokens, width]`
/// rows in the backend's own representation.
pub trait Backend {
    type Act;
    /// Embedding rows of `step.ids`.
    fn embed(&mut self, step: &StepBatch) -> Result<Self::Act>;
    fn rms_norm(&mut self, x: &Self::Act, w: Norm) -> Result<Self::Act>;
    /// Q, K and V projections of layer `layer` (with their bias, if any).
    fn qkv(&mut self, layer: usize, x: &Self::Act) -> Result<[Self::Act; 3]>;
    /// RoPE on Q and K at the step's positions, K/V into the paged cache,
    /// then causal attention of every query over its sequence's cache.
    fn attention(
        &mut self,
        layer: usize,
        step: &StepBatch,
        qkv: [Self::Act; 3],
    ) -> Result<Self::Act>;
    /// `x += a W^T` for the projection `w` of `layer`.
    fn add_projection(
        &mut self,
        layer: usize,
        w: Proj,
        a: &Self::Act,
        x: &mut Self::Act,
    ) -> Result<()>;
    /// `silu(x Wg^T) * (x Wu^T)`.
    fn swiglu(&mut self, layer: usize, x: &Self::Act) -> Result<Self::Act>;
    /// Rows `rows` of `x`.
    fn select_rows(&mut self, x: &Self::Act, rows: &[u32]) -> Result<Self::Act>;
    /// The LM head on final-normed rows: `[rows, vocab]` logits.
    fn lm_head(&mut self, x: &Self::Act) -> Result<Self::Act>;
}

/// The model: the one sequence of operations every backend runs. Returns
/// the logits of `step.logit_rows` (`None` when no chunk wants them).
pub fn forward<B: Backend>(
    cfg: &ModelConfig,
    b: &mut B,
    step: &StepBatch,
) -> Result<Option<B::Act>> {
    if step.ids.is_empty() {
        return Ok(None);
    }
    let mut x = b.embed(step)?;
    for layer in 0..cfg.num_layers {
        let h = b.rms_norm(&x, Norm::Attn(layer))?;
        let qkv = b.qkv(layer, &h)?;
        let a = b.attention(layer, step, qkv)?;
        b.add_projection(layer, Proj::Out, &a, &mut x)?;
        let h = b.rms_norm(&x, Norm::Ffn(layer))?;
        let g = b.swiglu(layer, &h)?;
        b.add_projection(layer, Proj::Down, &g, &mut x)?;
    }
    if step.logit_rows.is_empty() {
        return Ok(None);
    }
    let last = b.select_rows(&x, &step.logit_rows)?;
    let last = b.rms_norm(&last, Norm::Final)?;
    Ok(Some(b.lm_head(&last)?))
}

/// RoPE inverse frequencies, the same f32 arithmetic as candle-transformers' llama.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let hd = cfg.head_dim;
    (0..hd)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / hd as f32))
        .collect()
}

pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    inv_freq: Vec<f32>,
}

impl Model {
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Model {
        Model {
            inv_freq: inv_freq(&config),
            config,
            weights,
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

    /// Runs one step on the CPU. Returns `[n, vocab]` f32 logits, one row
    /// per chunk with `want_logits`, in chunk order (`None` when no chunk
    /// wants them).
    pub fn forward(&self, kv: &mut KvPool, chunks: &[SeqChunk]) -> Result<Option<Tensor>> {
        let step = StepBatch::new(chunks);
        let slots = chunks
            .iter()
            .flat_map(|c| {
                (0..c.tokens.len()).map(move |i| TokenSlot {
                    block_table: c.block_table,
                    pos: c.start_pos + i,
                })
            })
            .collect();
        let (cos, sin) = self.rope_tables(&step.positions);
        let mut cpu = CpuBackend {
            model: self,
            kv,
            slots,
            cos,
            sin,
        };
        forward(&self.config, &mut cpu, &step)
    }
}

/// The CPU backend: candle for norms and matmuls, our paged attention.
struct CpuBackend<'a> {
    model: &'a Model,
    kv: &'a mut KvPool,
    slots: Vec<TokenSlot<'a>>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Backend for CpuBackend<'_> {
    type Act = Tensor;

    fn embed(&mut self, step: &StepBatch) -> Result<Tensor> {
        self.model.weights.embedding.rows(&step.ids)
    }

    fn rms_norm(&mut self, x: &Tensor, w: Norm) -> Result<Tensor> {
        let ws = &self.model.weights;
        let w = match w {
            Norm::Attn(l) => &ws.layers[l].attn_norm,
            Norm::Ffn(l) => &ws.layers[l].ffn_norm,
            Norm::Final => &ws.final_norm,
        };
        let eps = self.model.config.rms_norm_eps as f32;
        Ok(candle_nn::ops::rms_norm(x, w, eps)?)
    }

    fn qkv(&mut self, layer: usize, x: &Tensor) -> Result<[Tensor; 3]> {
        let l = &self.model.weights.layers[layer];
        Linear::forward_many([&l.wq, &l.wk, &l.wv], x)
    }

    fn attention(&mut self, layer: usize, step: &StepBatch, qkv: [Tensor; 3]) -> Result<Tensor> {
        let cfg = &self.model.config;
        let n = step.ids.len();
        let [q, k, v] = qkv;
        let mut q = q.flatten_all()?.to_vec1::<f32>()?;
        let mut k = k.flatten_all()?.to_vec1::<f32>()?;
        let v = v.flatten_all()?.to_vec1::<f32>()?;
        self.model
            .apply_rope(&mut q, cfg.num_heads, &self.cos, &self.sin);
        self.model
            .apply_rope(&mut k, cfg.num_kv_heads, &self.cos, &self.sin);
        debug_assert_eq!(k.len(), n * cfg.num_kv_heads * cfg.head_dim);
        let geometry = self.kv.geometry;
        let slots = &self.slots;
        let heads = cfg.num_heads;
        let attn = match &mut self.kv.storage {
            KvStorage::F32(l) => attend(&geometry, &mut l[layer], slots, &q, &k, &v, heads),
            KvStorage::F16(l) => attend(&geometry, &mut l[layer], slots, &q, &k, &v, heads),
            KvStorage::Bf16(l) => attend(&geometry, &mut l[layer], slots, &q, &k, &v, heads),
        };
        Ok(Tensor::from_vec(
            attn,
            (n, cfg.num_heads * cfg.head_dim),
            &Device::Cpu,
        )?)
    }

    fn add_projection(&mut self, layer: usize, w: Proj, a: &Tensor, x: &mut Tensor) -> Result<()> {
        let l = &self.model.weights.layers[layer];
        let w = match w {
            Proj::Out => &l.wo,
            Proj::Down => &l.w_down,
        };
        *x = (w.forward(a)? + &*x)?;
        Ok(())
    }

    fn swiglu(&mut self, layer: usize, x: &Tensor) -> Result<Tensor> {
        let l = &self.model.weights.layers[layer];
        let [gate, up] = Linear::forward_many([&l.w_gate, &l.w_up], x)?;
        let shape = gate.shape().clone();
        let mut g = gate.flatten_all()?.to_vec1::<f32>()?;
        crate::activation::swiglu_in_place(&mut g, &up.flatten_all()?.to_vec1::<f32>()?);
        Ok(Tensor::from_vec(g, shape, &Device::Cpu)?)
    }

    fn select_rows(&mut self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        let rows = Tensor::new(rows, &Device::Cpu)?;
        Ok(x.index_select(&rows, 0)?)
    }

    fn lm_head(&mut self, x: &Tensor) -> Result<Tensor> {
        let logits = self.model.weights.lm_head.forward(x)?;
        debug_assert_eq!(logits.dim(D::Minus1)?, self.model.config.vocab_size);
        Ok(logits)
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
