//! The CUDA backend: the model's weights on one GPU, the paged KV cache in
//! device memory, and [`Backend`] implemented with the NVRTC kernels of
//! `kernels/` and cuBLAS/cuBLASLt ([`envelope_cuda::runtime`]). The model
//! code ([`crate::model::forward`]), the scheduler, the block bookkeeping,
//! the batch policies, sampling and the server are the CPU engine's; only
//! the operations run here.
//!
//! Precisions: `f32` (f32 activations and GEMMs, for tight comparison with
//! the CPU), `f16`, `bf16` and `as-stored` (bf16 activations; GGUF Q4_0,
//! Q4_1 and Q8_0 blocks are uploaded as they are and dequantised to bf16 on
//! the device, other GGUF formats are dequantised on the host), and `fp8`
//! (layer matrices in e4m3 with a per-tensor scale, activations quantised
//! per tensor before each fp8 GEMM; embedding, LM head and norms stay bf16;
//! compute capability 8.9+). `dummy:` presets are generated on the device by
//! the same counter-based hash as on the CPU, so the two hold the same
//! weights without shipping a file.

mod backend;
mod graphs;
mod meta;
mod precision;
mod upload;
pub use backend::Act;
use backend::{CudaBackend, DevMeta};
pub use graphs::GraphStats;
pub use meta::StepMeta;
pub use precision::{
    activation_bytes, activation_dtype, check_runs_on_cuda, default_kv_dtype, kv_dtype,
    weight_bytes,
};
use upload::Uploader;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_cache::KvGeometry;
use crate::model::{self, SeqChunk, StepBatch};
use crate::precision::Precision;
use crate::sampling::DevicePick;
use crate::settings::{EngineSettings, KvBudget};
use crate::weights::{self, ModelSource, ModelWeights, Role, WeightReport};
use envelope_cuda::memory;
use envelope_cuda::runtime::{le_bytes, Buf, DType, F32Slice, Fp8Buf, Gpu};

/// A weight matrix `[out, inner]` on the device.
pub enum DevMatrix {
    Dense(Buf),
    Fp8(Fp8Buf),
}

struct DevLinear {
    w: DevMatrix,
    bias: Option<Buf>,
    out: usize,
    inner: usize,
}

impl DevLinear {
    fn bytes(&self) -> usize {
        let w = match &self.w {
            DevMatrix::Dense(b) => b.bytes(),
            DevMatrix::Fp8(f) => f.data.bytes() + 4,
        };
        w + self.bias.as_ref().map_or(0, |b| b.bytes())
    }
}

struct DevLayer {
    attn_norm: Buf,
    ffn_norm: Buf,
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    gate: DevLinear,
    up: DevLinear,
    down: DevLinear,
}

/// The paged KV cache on the device: per layer, K and V laid out
/// `[block][slot][kv_head][head_dim]` like the CPU pool.
pub struct DevKv {
    k: Vec<Buf>,
    v: Vec<Buf>,
    pub geometry: KvGeometry,
    pub dtype: DType,
}

/// What [`CudaModel::allocate_kv`] made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPlan {
    pub num_blocks: usize,
    pub bytes_per_token: usize,
    pub pool_bytes: usize,
}

/// A model loaded on a GPU.
pub struct CudaModel {
    pub config: ModelConfig,
    pub precision: Precision,
    pub gpu: Gpu,
    act: DType,
    embedding: Buf,
    /// `None`: tied to the embedding.
    lm_head: Option<DevLinear>,
    final_norm: Buf,
    layers: Vec<DevLayer>,
    inv_freq: F32Slice,
    kv: Option<DevKv>,
    /// Decode-step graphs (set up with the KV pool).
    graphs: graphs::GraphSet,
    pub report: WeightReport,
}

impl Drop for CudaModel {
    fn drop(&mut self) {
        // The buffers and handles free themselves on the device's context,
        // which may not be current on the dropping thread. Graphs go first:
        // they reference the modules and library handles `gpu` owns.
        let _ = self.gpu.bind();
        self.graphs = graphs::GraphSet::default();
    }
}

impl CudaModel {
    /// Loads `source` onto CUDA device `ordinal` in `precision`.
    ///
    /// # Errors
    /// No usable device (the reason), a precision the device cannot run, or
    /// a model that does not load.
    pub fn load(
        source: &ModelSource,
        cfg: &ModelConfig,
        precision: Precision,
        ordinal: usize,
    ) -> Result<CudaModel> {
        let act = activation_dtype(precision)?;
        let gpu = Gpu::open(ordinal)?;
        gpu.bind()?;
        if precision == Precision::Fp8 && !gpu.info.fp8 {
            let (ma, mi) = gpu.device.info.compute_capability;
            return Err(EngineError::InvalidSetting {
                field: "precision",
                message: format!(
                    "fp8 needs compute capability 8.9 or newer; {} is {ma}.{mi}",
                    gpu.device.info.name
                ),
            });
        }
        let up = Uploader {
            gpu: &gpu,
            act,
            fp8: precision == Precision::Fp8,
        };
        let (h, qd, kvd, f) = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        );
        let (embedding, lm_head, final_norm, layers) = match source {
            ModelSource::Dummy { seed, .. } => {
                let need = |r: Role, l: usize| -> Result<Buf> {
                    up.dummy(cfg, *seed, r, l)?
                        .ok_or_else(|| EngineError::model("dummy", format!("no tensor for {r:?}")))
                };
                let embedding = need(Role::Embedding, 0)?;
                let lm_head = up.dummy(cfg, *seed, Role::LmHead, 0)?.map(|w| DevLinear {
                    w: DevMatrix::Dense(w),
                    bias: None,
                    out: cfg.vocab_size,
                    inner: h,
                });
                let mut layers = Vec::with_capacity(cfg.num_layers);
                for l in 0..cfg.num_layers {
                    let lin = |r: Role, b: Option<Role>, shape: (usize, usize)| {
                        up.dummy_linear(cfg, *seed, (r, b), l, shape)
                    };
                    layers.push(DevLayer {
                        attn_norm: need(Role::AttnNorm, l)?,
                        ffn_norm: need(Role::FfnNorm, l)?,
                        q: lin(Role::Q, Some(Role::QBias), (qd, h))?,
                        k: lin(Role::K, Some(Role::KBias), (kvd, h))?,
                        v: lin(Role::V, Some(Role::VBias), (kvd, h))?,
                        o: lin(Role::O, None, (h, qd))?,
                        gate: lin(Role::Gate, None, (f, h))?,
                        up: lin(Role::Up, None, (f, h))?,
                        down: lin(Role::Down, None, (h, f))?,
                    });
                }
                (embedding, lm_head, need(Role::FinalNorm, 0)?, layers)
            }
            _ => {
                let host: ModelWeights = weights::load_weights(source, cfg, Precision::AsStored)?;
                let embedding = up.matrix(&host.embedding)?;
                let lm_head = if host.tied {
                    None
                } else {
                    let w = up.matrix(host.lm_head.weight())?;
                    Some(DevLinear {
                        w: DevMatrix::Dense(w),
                        bias: None,
                        out: cfg.vocab_size,
                        inner: h,
                    })
                };
                let mut layers = Vec::with_capacity(cfg.num_layers);
                for l in &host.layers {
                    layers.push(DevLayer {
                        attn_norm: up.tensor(&l.attn_norm)?,
                        ffn_norm: up.tensor(&l.ffn_norm)?,
                        q: up.host_linear(&l.wq)?,
                        k: up.host_linear(&l.wk)?,
                        v: up.host_linear(&l.wv)?,
                        o: up.host_linear(&l.wo)?,
                        gate: up.host_linear(&l.w_gate)?,
                        up: up.host_linear(&l.w_up)?,
                        down: up.host_linear(&l.w_down)?,
                    });
                }
                (embedding, lm_head, up.tensor(&host.final_norm)?, layers)
            }
        };
        gpu.synchronize()?;
        let inv_freq = gpu.upload_f32_slice(&model::inv_freq(cfg))?;
        let layers_bytes: usize = layers
            .iter()
            .map(|l| {
                l.attn_norm.bytes()
                    + l.ffn_norm.bytes()
                    + [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                        .iter()
                        .map(|w| w.bytes())
                        .sum::<usize>()
            })
            .sum();
        let lm_head_bytes = lm_head.as_ref().map_or(0, |l| l.bytes());
        let report = WeightReport {
            total_bytes: embedding.bytes() + layers_bytes + lm_head_bytes + final_norm.bytes(),
            embedding_bytes: embedding.bytes(),
            layers_bytes,
            lm_head_bytes,
            num_parameters: cfg.num_parameters(),
            formats: if precision == Precision::Fp8 {
                vec!["fp8_e4m3".into(), act.suffix().into()]
            } else {
                vec![act.suffix().into()]
            },
        };
        Ok(CudaModel {
            config: cfg.clone(),
            precision,
            act,
            embedding,
            lm_head,
            final_norm,
            layers,
            inv_freq,
            kv: None,
            graphs: graphs::GraphSet::default(),
            report,
            gpu,
        })
    }

    /// The activation dtype.
    pub fn act(&self) -> DType {
        self.act
    }

    /// Sizes and allocates the KV pool: `Bytes` exactly, or
    /// `FractionOfAvailable(f)` = `f` x (free device memory after the
    /// weights - the activation reserve of [`activation_bytes`]).
    ///
    /// # Errors
    /// An unsupported KV dtype, a budget that holds no block, or an
    /// allocation failure.
    pub fn allocate_kv(&mut self, cfg: &EngineSettings) -> Result<KvPlan> {
        let dtype = kv_dtype(self.act, cfg.kv_dtype)?;
        let c = &self.config;
        let bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.size();
        // Free the old pool (if any) before measuring what is free; graphs
        // captured over it go first.
        self.graphs = graphs::GraphSet::default();
        self.kv = None;
        self.gpu.trim_pool();
        let (free, total) = self.gpu.mem_info()?;
        let state = memory::MemoryState {
            total_bytes: total,
            free_bytes: free,
            workspace_bytes: activation_bytes(
                c,
                self.act,
                cfg.scheduler.max_num_batched_tokens,
                cfg.scheduler.max_num_seqs,
            ),
        };
        let budget = match cfg.kv_budget {
            // Must fit beside the activation reserve: an error with every
            // figure, not an allocation failure halfway through the layers.
            KvBudget::Bytes(b) => memory::exact_pool_bytes(b, state)?,
            KvBudget::FractionOfAvailable(f) => {
                (memory::available_bytes(state) as f64 * f) as usize
            }
        };
        let num_blocks = budget / (bytes_per_token * cfg.block_size);
        if num_blocks == 0 {
            return Err(EngineError::InvalidSetting {
                field: "kv_cache_bytes",
                message: format!(
                    "{budget} bytes of GPU memory hold no block of {} tokens ({bytes_per_token} bytes per token)",
                    cfg.block_size
                ),
            });
        }
        let geometry = KvGeometry {
            num_layers: c.num_layers,
            num_blocks,
            block_size: cfg.block_size,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        let mut k = Vec::with_capacity(c.num_layers);
        let mut v = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            k.push(self.gpu.zeros(dtype, geometry.layer_elems())?);
            v.push(self.gpu.zeros(dtype, geometry.layer_elems())?);
        }
        self.gpu.synchronize()?;
        self.kv = Some(DevKv {
            k,
            v,
            geometry,
            dtype,
        });
        self.graphs = graphs::GraphSet::new(cfg.scheduler.max_num_seqs, self.gpu.can_capture());
        Ok(KvPlan {
            num_blocks,
            bytes_per_token,
            pool_bytes: 2 * c.num_layers * geometry.layer_elems() * dtype.size(),
        })
    }

    /// Runs one step: one f32 logits row per chunk that wants logits.
    ///
    /// # Errors
    /// No KV pool yet, a malformed step, or a CUDA failure.
    pub fn forward(&self, chunks: &[SeqChunk]) -> Result<Vec<Vec<f32>>> {
        let Some(logits) = self.forward_logits(chunks)? else {
            return Ok(Vec::new());
        };
        let v = self.gpu.download(&logits.buf)?;
        Ok(v.chunks_exact(self.config.vocab_size)
            .map(|r| r.to_vec())
            .collect())
    }

    /// Runs one step and picks the greedy token of each logits row on the
    /// device (the lowest index on a tie, as the CPU).
    ///
    /// # Errors
    /// As [`CudaModel::forward`].
    pub fn forward_greedy(&mut self, chunks: &[SeqChunk]) -> Result<Vec<u32>> {
        let rows = chunks.iter().filter(|c| c.want_logits).count();
        self.forward_sample(chunks, &vec![DevicePick::GREEDY; rows])
    }

    /// Runs one step and picks each logits row's token on the device as
    /// `picks[row]` says (`kernels/sampling.cu`'s `sample`): only the
    /// tokens come back, not the `[rows, vocab]` logits.
    ///
    /// # Errors
    /// As [`CudaModel::forward`], and a pick count that is not the row count.
    pub fn forward_sample(
        &mut self,
        chunks: &[SeqChunk],
        picks: &[DevicePick],
    ) -> Result<Vec<u32>> {
        // Decode steps replay a captured graph when they can.
        let mut set = std::mem::take(&mut self.graphs);
        let replayed = self.decode_from_graph(&mut set, chunks, picks);
        self.graphs = set;
        if let Some(tokens) = replayed? {
            return Ok(tokens);
        }
        if chunks.iter().all(|c| c.tokens.len() == 1) {
            self.graphs.stats.eager_decode_steps += 1;
        }
        let Some(logits) = self.forward_logits(chunks)? else {
            return Ok(Vec::new());
        };
        if picks.len() != logits.rows {
            return Err(EngineError::InvalidSetting {
                field: "engine",
                message: format!("{} picks for {} logits rows", picks.len(), logits.rows),
            });
        }
        let params: Vec<f32> = picks
            .iter()
            .flat_map(|p| [p.temperature, p.top_p, p.u])
            .collect();
        Ok(self
            .gpu
            .sample(&logits.buf, logits.rows, self.config.vocab_size, &params)?)
    }

    /// `cuda:0 NVIDIA H200 (compute_90); kernels: nvrtc 13.0 (...); GEMMs:
    /// cublas; CUDA graphs: enabled`, with `auto`'s fallbacks: what a profile or
    /// report measured with.
    pub fn describe(&self) -> String {
        let (d, rt) = (&self.gpu.device.info, &self.gpu.info);
        let mut s = format!(
            "cuda:{} {} ({}); kernels: {}; GEMMs: {}; CUDA graphs: {}",
            d.ordinal,
            d.name,
            rt.arch,
            rt.kernels,
            rt.gemm,
            match self.graphs_off() {
                None if self.graphs.stats.captured + self.graphs.stats.replayed > 0 => format!(
                    "enabled ({} captured, {} replayed)",
                    self.graphs.stats.captured, self.graphs.stats.replayed
                ),
                None => "enabled".to_string(),
                Some(why) => format!("off ({why})"),
            }
        );
        for f in &rt.fallbacks {
            s.push_str(&format!("; fallback: {f}"));
        }
        s
    }

    /// How many decode graphs were captured and replayed, and decode steps
    /// run without one.
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats
    }

    /// Why decode steps run without graphs (`None`: they use them).
    pub fn graphs_off(&self) -> Option<&str> {
        self.graphs.off()
    }

    /// Switches decode graphs on or off (captured graphs are kept).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.set_enabled(on);
    }

    /// The step's `[rows, vocab]` f32 logits, left on the device.
    fn forward_logits(&self, chunks: &[SeqChunk]) -> Result<Option<Act>> {
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| EngineError::InvalidSetting {
                field: "kv_cache",
                message: "the CUDA KV pool is not allocated (allocate_kv first)".into(),
            })?;
        self.gpu.bind()?;
        let step = StepBatch::new(chunks);
        if step.ids.is_empty() {
            return Ok(None);
        }
        // The embedding kernel does not bound-check: an id past the table
        // would read out of bounds (and a fault kills the context).
        let vocab = self.config.vocab_size;
        if let Some(&id) = step.ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest {
                param: "prompt",
                message: format!("token id {id} is outside the vocabulary ({vocab})"),
            });
        }
        let meta = StepMeta::build(&step, kv.geometry.block_size)?;
        let g = &self.gpu;
        let dev = DevMeta {
            ids: g.upload(DType::U32, &le_bytes(&step.ids, u32::to_le_bytes))?,
            positions: g.upload(DType::U32, &le_bytes(&meta.positions, u32::to_le_bytes))?,
            slots: g.upload(DType::I64, &le_bytes(&meta.slots, i64::to_le_bytes))?,
            tables: g.upload(DType::I32, &le_bytes(&meta.tables, i32::to_le_bytes))?,
            context_lens: g.upload(DType::I32, &le_bytes(&meta.context_lens, i32::to_le_bytes))?,
            cu_q_lens: g.upload(DType::I32, &le_bytes(&meta.cu_q_lens, i32::to_le_bytes))?,
            logit_rows: g.upload(DType::U32, &le_bytes(&step.logit_rows, u32::to_le_bytes))?,
        };
        let mut b = CudaBackend {
            m: self,
            logit_rows: &step.logit_rows,
            kv,
            meta: &meta,
            dev: &dev,
        };
        model::forward(&self.config, &mut b, &step)
    }
}

#[cfg(test)]
mod tests;
