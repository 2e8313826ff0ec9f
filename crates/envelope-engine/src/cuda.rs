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

mod graphs;
pub use graphs::GraphStats;

use crate::config::{ModelConfig, RopeStyle};
use crate::engine::{EngineConfig, KvBudget};
use crate::error::{EngineError, Result};
use crate::kv_cache::KvGeometry;
use crate::linear::{Linear, Matrix};
use crate::model::{self, Backend, Norm, Proj, SeqChunk, StepBatch};
use crate::precision::{KvDtype, Precision};
use crate::sampling::DevicePick;
use crate::weights::{self, DummyInit, ModelSource, ModelWeights, Role, WeightReport};
use candle_core::{DType as CDType, Device as CDevice, Tensor};
use envelope_cuda::runtime::{le_bytes, AttnDims, Buf, DType, F32Slice, Fp8Buf, Gpu};
use envelope_cuda::{geometry, memory};

/// The activation dtype of a precision on CUDA.
///
/// # Errors
/// `q8_0` and `q4_0` (their GEMMs are CPU kernels).
pub fn activation_dtype(p: Precision) -> Result<DType> {
    Ok(match p {
        Precision::F32 => DType::F32,
        Precision::F16 => DType::F16,
        Precision::Bf16 | Precision::AsStored | Precision::Fp8 => DType::Bf16,
        Precision::Q8_0 | Precision::Q4_0 => {
            return Err(EngineError::InvalidSetting {
                field: "precision",
                message: format!(
                    "{p} GEMMs are CPU kernels; on CUDA use as-stored (GGUF Q4/Q8 blocks are dequantised to bf16 at load), bf16, f16, f32 or fp8"
                ),
            })
        }
    })
}

/// Whether a precision (and a KV dtype, when one is asked for) can run on
/// CUDA at all: `--device auto` falls back to the CPU when not.
///
/// # Errors
/// The reason, as [`activation_dtype`] and [`kv_dtype`] give it.
pub fn check_runs_on_cuda(p: Precision, kv: Option<KvDtype>) -> Result<()> {
    let act = activation_dtype(p)?;
    if let Some(k) = kv {
        kv_dtype(act, k)?;
    }
    Ok(())
}

/// The KV-cache dtype a precision gets on CUDA when none is asked for: the
/// activation dtype.
pub fn default_kv_dtype(p: Precision) -> KvDtype {
    match p {
        Precision::F32 => KvDtype::F32,
        Precision::F16 => KvDtype::F16,
        _ => KvDtype::Bf16,
    }
}

/// The KV-cache dtype on CUDA: the kernels pair f32 activations with any
/// cache dtype, and 16-bit activations with a cache of the same dtype.
///
/// # Errors
/// Any other pairing, naming the `--kv-dtype` to use.
pub fn kv_dtype(act: DType, kv: KvDtype) -> Result<DType> {
    let want = match kv {
        KvDtype::F32 => DType::F32,
        KvDtype::F16 => DType::F16,
        KvDtype::Bf16 => DType::Bf16,
    };
    if act == DType::F32 || act == want {
        return Ok(want);
    }
    Err(EngineError::InvalidSetting {
        field: "kv_dtype",
        message: format!(
            "on CUDA, {} activations need a {} KV cache (got {kv}): pass --kv-dtype {}",
            act.suffix(),
            act.suffix(),
            act.suffix()
        ),
    })
}

/// Device memory kept out of the KV pool for one step's activations: the
/// largest step (`max_tokens` tokens) holds the residual stream, a norm
/// output, Q/K/V, the attention output, gate/up/SiLU rows and an fp8 copy,
/// plus `max_rows` rows of f32 logits and the largest split decode
/// attention's partial records (at most 512 (sequence, head) pairs, one
/// partition per 512 positions of the model's context); 512 MiB more for
/// cuBLAS workspaces and the allocator.
pub fn activation_bytes(c: &ModelConfig, act: DType, max_tokens: usize, max_rows: usize) -> usize {
    let (h, q, kv, f) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    );
    let per_token = (3 * h + 2 * q + 2 * kv + 3 * f) * act.size() + f.max(h);
    let split_partials = 4 * geometry::decode_partials_len(
        1,
        geometry::DECODE_SPLIT_MAX_BLOCKS,
        c.head_dim,
        c.max_position_embeddings
            .div_ceil(geometry::DECODE_PARTITION)
            .max(1),
    );
    max_tokens * per_token + max_rows * c.vocab_size * 4 + split_partials + (512 << 20)
}

/// Everything a step needs to know on the device, built on the host from
/// the chunks: where each new token's K/V goes, each sequence's block
/// table and context, where its query rows start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMeta {
    pub positions: Vec<u32>,
    /// Flat cache slot of every new token (`block * block_size + pos % block_size`).
    pub slots: Vec<i64>,
    pub tables: Vec<i32>,
    pub max_blocks_per_seq: usize,
    /// Keys each sequence attends to after this step (`start + len`).
    pub context_lens: Vec<i32>,
    /// `[0, q0, q0 + q1, ...]`.
    pub cu_q_lens: Vec<i32>,
    pub max_q_len: usize,
    pub is_decode: bool,
}

impl StepMeta {
    /// # Errors
    /// A block table that does not cover its chunk.
    pub fn build(step: &StepBatch, block_size: usize) -> Result<StepMeta> {
        let chunks = step.chunks;
        let mut slots = Vec::with_capacity(step.ids.len());
        for c in chunks {
            slots.extend(geometry::slot_mapping(
                c.block_table,
                c.start_pos..c.start_pos + c.tokens.len(),
                block_size,
            )?);
        }
        let ctx: Vec<usize> = chunks
            .iter()
            .map(|c| c.start_pos + c.tokens.len())
            .collect();
        let tables: Vec<&[u32]> = chunks.iter().map(|c| c.block_table).collect();
        let flat = geometry::flatten_block_tables(&tables, &ctx, block_size)?;
        let q_lens: Vec<usize> = chunks.iter().map(|c| c.tokens.len()).collect();
        Ok(StepMeta {
            positions: step.positions.iter().map(|&p| p as u32).collect(),
            slots,
            tables: flat.data,
            max_blocks_per_seq: flat.max_blocks_per_seq,
            context_lens: ctx.iter().map(|&n| n as i32).collect(),
            cu_q_lens: geometry::cu_seqlens(&q_lens),
            max_q_len: q_lens.iter().copied().max().unwrap_or(0),
            is_decode: step.is_decode(),
        })
    }
}

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

/// Turns host weights and dummy presets into device buffers.
struct Uploader<'a> {
    gpu: &'a Gpu,
    act: DType,
    fp8: bool,
}

fn tensor_bytes(t: &Tensor, act: DType) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match act {
        DType::F16 => le_bytes(
            &t.to_dtype(CDType::F16)?.to_vec1::<half::f16>()?,
            half::f16::to_le_bytes,
        ),
        DType::Bf16 => le_bytes(
            &t.to_dtype(CDType::BF16)?.to_vec1::<half::bf16>()?,
            half::bf16::to_le_bytes,
        ),
        _ => le_bytes(
            &t.to_dtype(CDType::F32)?.to_vec1::<f32>()?,
            f32::to_le_bytes,
        ),
    })
}

impl Uploader<'_> {
    fn tensor(&self, t: &Tensor) -> Result<Buf> {
        Ok(self.gpu.upload(self.act, &tensor_bytes(t, self.act)?)?)
    }

    fn matrix(&self, m: &Matrix) -> Result<Buf> {
        Ok(match m {
            Matrix::Dense(t) => self.tensor(t)?,
            Matrix::Blocks(q) => {
                let blocks = self.gpu.upload(DType::U8, &q.data)?;
                let out = self.gpu.empty(self.act, q.n * q.k)?;
                self.gpu
                    .dequant(q.format.name(), &blocks, &out, q.n * q.k / 32)?;
                out
            }
            Matrix::Quant(q) => self.tensor(&q.dequantize(&CDevice::Cpu)?)?,
            Matrix::Fp8(m) => self.tensor(&Tensor::from_vec(
                m.dequantize(),
                (m.n, m.k),
                &CDevice::Cpu,
            )?)?,
        })
    }

    /// A layer matrix: dense in the activation dtype, or fp8.
    fn linear(&self, dense: Buf, bias: Option<Buf>, out: usize, inner: usize) -> Result<DevLinear> {
        let w = if self.fp8 {
            let q = self.gpu.fp8_buf(dense.len)?;
            self.gpu.quantize_fp8_into(&dense, dense.len, &q)?;
            self.gpu.synchronize()?;
            DevMatrix::Fp8(q)
        } else {
            DevMatrix::Dense(dense)
        };
        Ok(DevLinear {
            w,
            bias,
            out,
            inner,
        })
    }

    fn host_linear(&self, l: &Linear) -> Result<DevLinear> {
        let (out, inner) = l.weight().dims2()?;
        let dense = self.matrix(l.weight())?;
        let bias = l.bias().map(|b| self.tensor(b)).transpose()?;
        self.linear(dense, bias, out, inner)
    }

    /// A `dummy:` tensor generated on the device.
    fn dummy(&self, cfg: &ModelConfig, seed: u64, role: Role, layer: usize) -> Result<Option<Buf>> {
        Ok(match weights::dummy_init(cfg, role) {
            DummyInit::Absent => None,
            DummyInit::Ones(n) => Some(self.gpu.upload_f32(self.act, &vec![1.0; n])?),
            DummyInit::Uniform { shape, scale } => {
                let len = shape.iter().product();
                let b = self.gpu.empty(self.act, len)?;
                let key = weights::dummy_key(seed, &weights::hf_name(role, layer));
                self.gpu.dummy_fill(&b, key, scale)?;
                Some(b)
            }
        })
    }

    fn dummy_linear(
        &self,
        cfg: &ModelConfig,
        seed: u64,
        (role, bias): (Role, Option<Role>),
        layer: usize,
        shape: (usize, usize),
    ) -> Result<DevLinear> {
        let dense = self
            .dummy(cfg, seed, role, layer)?
            .ok_or_else(|| EngineError::model("dummy", format!("no tensor for {role:?}")))?;
        let bias = match bias {
            Some(r) => self.dummy(cfg, seed, r, layer)?,
            None => None,
        };
        self.linear(dense, bias, shape.0, shape.1)
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
    pub fn allocate_kv(&mut self, cfg: &EngineConfig) -> Result<KvPlan> {
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
            KvBudget::Bytes(b) => memory::kv_pool_bytes(memory::KvBudget::Bytes(b), state)?,
            KvBudget::FractionOfAvailable(f) => {
                (free.saturating_sub(state.workspace_bytes) as f64 * f) as usize
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

struct DevMeta {
    ids: Buf,
    positions: Buf,
    slots: Buf,
    tables: Buf,
    context_lens: Buf,
    cu_q_lens: Buf,
    logit_rows: Buf,
}

/// Activations on the device: `[rows, cols]`.
pub struct Act {
    buf: Buf,
    rows: usize,
    cols: usize,
}

struct CudaBackend<'a> {
    m: &'a CudaModel,
    /// The step's logit rows, uploaded as `dev.logit_rows`.
    logit_rows: &'a [u32],
    kv: &'a DevKv,
    meta: &'a StepMeta,
    /// Uploaded for this step, or a decode graph's fixed buffers.
    dev: &'a DevMeta,
}

impl CudaBackend<'_> {
    fn gpu(&self) -> &Gpu {
        &self.m.gpu
    }

    fn fp8_input(&self, x: &Act) -> Result<Option<Fp8Buf>> {
        if self.m.precision != Precision::Fp8 {
            return Ok(None);
        }
        let n = x.rows * x.cols;
        let q = self.gpu().fp8_buf(n)?;
        self.gpu().quantize_fp8_into(&x.buf, n, &q)?;
        Ok(Some(q))
    }

    /// `x W^T (+ bias)` into a new activation.
    fn linear(&self, x: &Act, x8: Option<&Fp8Buf>, l: &DevLinear) -> Result<Act> {
        let g = self.gpu();
        let y = g.empty(self.m.act, x.rows * l.out)?;
        match (&l.w, x8) {
            (DevMatrix::Dense(w), _) => g.gemm(&x.buf, w, &y, x.rows, l.inner, l.out, false)?,
            (DevMatrix::Fp8(w), Some(x8)) => g.gemm_fp8(x8, w, &y, x.rows, l.inner, l.out)?,
            (DevMatrix::Fp8(_), None) => {
                return Err(EngineError::InvalidSetting {
                    field: "precision",
                    message: "an fp8 weight met an unquantised activation".into(),
                })
            }
        }
        if let Some(b) = &l.bias {
            g.bias_add(&y, b, x.rows, l.out)?;
        }
        Ok(Act {
            buf: y,
            rows: x.rows,
            cols: l.out,
        })
    }
}

impl Backend for CudaBackend<'_> {
    type Act = Act;

    fn embed(&mut self, step: &StepBatch) -> Result<Act> {
        let (n, h) = (step.ids.len(), self.m.config.hidden_size);
        let out = self.gpu().empty(self.m.act, n * h)?;
        self.gpu()
            .embedding(&self.dev.ids, &self.m.embedding, &out, n, h)?;
        Ok(Act {
            buf: out,
            rows: n,
            cols: h,
        })
    }

    fn rms_norm(&mut self, x: &Act, w: Norm) -> Result<Act> {
        let w = match w {
            Norm::Attn(l) => &self.m.layers[l].attn_norm,
            Norm::Ffn(l) => &self.m.layers[l].ffn_norm,
            Norm::Final => &self.m.final_norm,
        };
        let out = self.gpu().empty(self.m.act, x.rows * x.cols)?;
        let eps = self.m.config.rms_norm_eps as f32;
        self.gpu().rmsnorm(&x.buf, w, &out, x.rows, x.cols, eps)?;
        Ok(Act {
            buf: out,
            rows: x.rows,
            cols: x.cols,
        })
    }

    fn qkv(&mut self, layer: usize, x: &Act) -> Result<[Act; 3]> {
        let l = &self.m.layers[layer];
        let x8 = self.fp8_input(x)?;
        Ok([
            self.linear(x, x8.as_ref(), &l.q)?,
            self.linear(x, x8.as_ref(), &l.k)?,
            self.linear(x, x8.as_ref(), &l.v)?,
        ])
    }

    fn attention(&mut self, layer: usize, step: &StepBatch, qkv: [Act; 3]) -> Result<Act> {
        let c = &self.m.config;
        let g = self.gpu();
        let [q, k, v] = qkv;
        let n = step.ids.len();
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        g.rope(
            &q.buf,
            &self.dev.positions,
            &self.m.inv_freq,
            n,
            c.num_heads,
            c.head_dim,
            interleaved,
        )?;
        g.rope(
            &k.buf,
            &self.dev.positions,
            &self.m.inv_freq,
            n,
            c.num_kv_heads,
            c.head_dim,
            interleaved,
        )?;
        let (kc, vc) = (&self.kv.k[layer], &self.kv.v[layer]);
        g.kv_append(
            &k.buf,
            &v.buf,
            kc,
            vc,
            &self.dev.slots,
            n,
            c.num_kv_heads,
            c.head_dim,
        )?;
        let out = g.empty(self.m.act, n * c.num_heads * c.head_dim)?;
        let dims = AttnDims {
            num_seqs: step.chunks.len(),
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: self.kv.geometry.block_size,
            max_blocks_per_seq: self.meta.max_blocks_per_seq,
        };
        if self.meta.is_decode {
            g.paged_decode(
                &out,
                &q.buf,
                kc,
                vc,
                &self.dev.tables,
                &self.dev.context_lens,
                dims,
            )?;
        } else {
            g.prefill(
                &out,
                &q.buf,
                kc,
                vc,
                &self.dev.tables,
                &self.dev.cu_q_lens,
                &self.dev.context_lens,
                self.meta.max_q_len,
                dims,
            )?;
        }
        Ok(Act {
            buf: out,
            rows: n,
            cols: c.num_heads * c.head_dim,
        })
    }

    fn add_projection(&mut self, layer: usize, w: Proj, a: &Act, x: &mut Act) -> Result<()> {
        let l = &self.m.layers[layer];
        let lin = match w {
            Proj::Out => &l.o,
            Proj::Down => &l.down,
        };
        match &lin.w {
            // The residual add fused into the GEMM (beta = 1).
            DevMatrix::Dense(w) => self
                .gpu()
                .gemm(&a.buf, w, &x.buf, a.rows, lin.inner, lin.out, true)?,
            DevMatrix::Fp8(_) => {
                let a8 = self.fp8_input(a)?;
                let y = self.linear(a, a8.as_ref(), lin)?;
                self.gpu().add_into(&x.buf, &y.buf, x.rows * x.cols)?;
            }
        }
        Ok(())
    }

    fn swiglu(&mut self, layer: usize, x: &Act) -> Result<Act> {
        let l = &self.m.layers[layer];
        let x8 = self.fp8_input(x)?;
        let gate = self.linear(x, x8.as_ref(), &l.gate)?;
        let up = self.linear(x, x8.as_ref(), &l.up)?;
        let n = gate.rows * gate.cols;
        self.gpu().silu_mul(&gate.buf, &up.buf, &gate.buf, n)?;
        Ok(gate)
    }

    fn select_rows(&mut self, x: &Act, rows: &[u32]) -> Result<Act> {
        let g = self.gpu();
        // The step's logit rows went up with the rest of the metadata.
        let uploaded;
        let ids = if rows == self.logit_rows {
            &self.dev.logit_rows
        } else {
            uploaded = g.upload(DType::U32, &le_bytes(rows, u32::to_le_bytes))?;
            &uploaded
        };
        let out = g.empty(self.m.act, rows.len() * x.cols)?;
        g.embedding(ids, &x.buf, &out, rows.len(), x.cols)?;
        Ok(Act {
            buf: out,
            rows: rows.len(),
            cols: x.cols,
        })
    }

    fn lm_head(&mut self, x: &Act) -> Result<Act> {
        let vocab = self.m.config.vocab_size;
        let w = match &self.m.lm_head {
            Some(DevLinear {
                w: DevMatrix::Dense(w),
                ..
            }) => w,
            Some(_) => {
                return Err(EngineError::InvalidSetting {
                    field: "precision",
                    message: "the LM head is kept dense".into(),
                })
            }
            None => &self.m.embedding,
        };
        let out = self.gpu().empty(DType::F32, x.rows * vocab)?;
        self.gpu()
            .gemm(&x.buf, w, &out, x.rows, x.cols, vocab, false)?;
        Ok(Act {
            buf: out,
            rows: x.rows,
            cols: vocab,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_map_to_activation_dtypes() {
        assert_eq!(activation_dtype(Precision::F32).unwrap(), DType::F32);
        assert_eq!(activation_dtype(Precision::Fp8).unwrap(), DType::Bf16);
        assert_eq!(activation_dtype(Precision::AsStored).unwrap(), DType::Bf16);
        let e = activation_dtype(Precision::Q4_0).unwrap_err().to_string();
        assert!(e.contains("CPU kernels"), "{e}");
    }

    #[test]
    fn kv_dtype_pairs_follow_the_kernels() {
        assert_eq!(kv_dtype(DType::F32, KvDtype::Bf16).unwrap(), DType::Bf16);
        assert_eq!(kv_dtype(DType::Bf16, KvDtype::Bf16).unwrap(), DType::Bf16);
        let e = kv_dtype(DType::Bf16, KvDtype::F32).unwrap_err().to_string();
        assert!(e.contains("--kv-dtype bf16"), "{e}");
        assert!(kv_dtype(DType::F16, KvDtype::Bf16).is_err());
        // Every accepted pair has kernels.
        for act in [DType::F32, DType::F16, DType::Bf16] {
            for kv in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
                if let Ok(c) = kv_dtype(act, kv) {
                    // Decode attention, and the merge of its split.
                    for entry in [
                        format!("paged_attention_decode_{}_{}", act.suffix(), c.suffix()),
                        format!("paged_attention_merge_{}", act.suffix()),
                    ] {
                        let found = envelope_cuda::kernels::KERNELS
                            .iter()
                            .any(|k| k.entries.contains(&entry.as_str()));
                        assert!(found, "{entry}");
                    }
                }
            }
        }
    }

    /// What `--device auto` falls back to the CPU for.
    #[test]
    fn what_cannot_run_on_cuda() {
        assert!(check_runs_on_cuda(Precision::Q8_0, None).is_err());
        assert!(check_runs_on_cuda(Precision::Bf16, Some(KvDtype::F32)).is_err());
        assert!(check_runs_on_cuda(Precision::Bf16, None).is_ok());
        assert!(check_runs_on_cuda(Precision::F32, Some(KvDtype::Bf16)).is_ok());
        assert!(check_runs_on_cuda(Precision::Fp8, Some(KvDtype::Bf16)).is_ok());
    }

    #[test]
    fn the_default_kv_dtype_is_always_accepted() {
        for p in Precision::ALL {
            if let Ok(act) = activation_dtype(p) {
                let kv = default_kv_dtype(p);
                assert_eq!(kv_dtype(act, kv).unwrap(), act, "{p}");
            }
        }
    }

    #[test]
    fn step_meta_of_a_mixed_batch() {
        // A 5-token prefill chunk at 0 (blocks 7, 2) and a decode at 9 (blocks 4, 1, 3).
        let (t0, t1) = ([7u32, 2], [4u32, 1, 3]);
        let chunks = [
            SeqChunk {
                tokens: &[1, 2, 3, 4, 5],
                start_pos: 0,
                block_table: &t0,
                want_logits: true,
            },
            SeqChunk {
                tokens: &[9],
                start_pos: 9,
                block_table: &t1,
                want_logits: true,
            },
        ];
        let step = StepBatch::new(&chunks);
        let m = StepMeta::build(&step, 4).unwrap();
        assert_eq!(m.positions, vec![0, 1, 2, 3, 4, 9]);
        assert_eq!(m.slots, vec![28, 29, 30, 31, 8, 3 * 4 + 1]);
        assert_eq!(m.max_blocks_per_seq, 3);
        assert_eq!(m.tables, vec![7, 2, 0, 4, 1, 3]);
        assert_eq!(m.context_lens, vec![5, 10]);
        assert_eq!(m.cu_q_lens, vec![0, 5, 6]);
        assert_eq!(m.max_q_len, 5);
        assert!(!m.is_decode);
        assert_eq!(step.logit_rows, vec![4, 5]);
        // A table too short for its chunk is an error, not a wild write.
        let short = [SeqChunk {
            tokens: &[1, 2],
            start_pos: 3,
            block_table: &t0[..1],
            want_logits: false,
        }];
        assert!(StepMeta::build(&StepBatch::new(&short), 4).is_err());
    }

    /// The CUDA backend's data flow on the CPU: the same [`StepMeta`]
    /// (positions, slot mapping, flattened block tables, context lengths,
    /// cumulative query lengths) feeding the CPU references of the kernels
    /// (`envelope_cuda::reference`: RoPE, KV append, paged attention), run
    /// through the shared [`model::forward`] over several steps (a prefill,
    /// then a chunked prefill beside a decode, then pure decodes, with
    /// scattered blocks) must give the CPU engine's logits. On a GPU the
    /// kernels are then checked against these references (cuda-selftest).
    #[test]
    fn kernel_references_through_step_meta_match_the_cpu_engine() {
        use crate::kv_cache::KvPool;
        use envelope_cuda::reference as r;
        struct RefBackend<'a> {
            m: &'a crate::model::Model,
            meta: StepMeta,
            k: &'a mut Vec<Vec<f32>>,
            v: &'a mut Vec<Vec<f32>>,
            block_size: usize,
        }
        fn t(x: &[f32], rows: usize) -> Tensor {
            Tensor::from_vec(x.to_vec(), (rows, x.len() / rows), &CDevice::Cpu).unwrap()
        }
        fn v(x: &Tensor) -> Vec<f32> {
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        }
        impl Backend for RefBackend<'_> {
            type Act = Tensor;
            fn embed(&mut self, step: &StepBatch) -> Result<Tensor> {
                self.m.weights.embedding.rows(&step.ids)
            }
            fn rms_norm(&mut self, x: &Tensor, w: Norm) -> Result<Tensor> {
                let ws = &self.m.weights;
                let w = match w {
                    Norm::Attn(l) => &ws.layers[l].attn_norm,
                    Norm::Ffn(l) => &ws.layers[l].ffn_norm,
                    Norm::Final => &ws.final_norm,
                };
                let eps = self.m.config.rms_norm_eps as f32;
                Ok(t(&r::rmsnorm(&v(x), &v(w), eps), x.dims()[0]))
            }
            fn qkv(&mut self, layer: usize, x: &Tensor) -> Result<[Tensor; 3]> {
                let l = &self.m.weights.layers[layer];
                Ok([l.wq.forward(x)?, l.wk.forward(x)?, l.wv.forward(x)?])
            }
            fn attention(
                &mut self,
                layer: usize,
                step: &StepBatch,
                qkv: [Tensor; 3],
            ) -> Result<Tensor> {
                let c = &self.m.config;
                let n = step.ids.len();
                let (mut q, mut k, vv) = (v(&qkv[0]), v(&qkv[1]), v(&qkv[2]));
                let f = r::inv_freq(c.rope_theta, c.head_dim);
                let il = c.rope_style == RopeStyle::Interleaved;
                r::rope(&mut q, &self.meta.positions, &f, c.num_heads, il);
                r::rope(&mut k, &self.meta.positions, &f, c.num_kv_heads, il);
                let stride = c.num_kv_heads * c.head_dim;
                r::kv_append(
                    &k,
                    &vv,
                    &mut self.k[layer],
                    &mut self.v[layer],
                    &self.meta.slots,
                    stride,
                );
                let out = r::paged_attention(
                    &q,
                    &self.k[layer],
                    &self.v[layer],
                    &self.meta.tables,
                    &self.meta.cu_q_lens,
                    &self.meta.context_lens,
                    r::AttnShape {
                        num_heads: c.num_heads,
                        num_kv_heads: c.num_kv_heads,
                        head_dim: c.head_dim,
                        block_size: self.block_size,
                        max_blocks_per_seq: self.meta.max_blocks_per_seq,
                    },
                );
                Ok(t(&out, n))
            }
            fn add_projection(
                &mut self,
                layer: usize,
                w: Proj,
                a: &Tensor,
                x: &mut Tensor,
            ) -> Result<()> {
                let l = &self.m.weights.layers[layer];
                let w = if w == Proj::Out { &l.wo } else { &l.w_down };
                let y = v(&w.forward(a)?);
                *x = t(&r::residual_add(&v(x), &y), x.dims()[0]);
                Ok(())
            }
            fn swiglu(&mut self, layer: usize, x: &Tensor) -> Result<Tensor> {
                let l = &self.m.weights.layers[layer];
                let (g, u) = (v(&l.w_gate.forward(x)?), v(&l.w_up.forward(x)?));
                Ok(t(&r::silu_mul(&g, &u), x.dims()[0]))
            }
            fn select_rows(&mut self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
                Ok(t(&r::embedding(rows, &v(x), x.dims()[1]), rows.len()))
            }
            fn lm_head(&mut self, x: &Tensor) -> Result<Tensor> {
                self.m.weights.lm_head.forward(x)
            }
        }

        let loaded = crate::load::load(
            "dummy:tiny@5",
            &crate::load::LoadOptions {
                precision: Precision::F32,
                tokenizer: None,
            },
        )
        .unwrap();
        let m = &loaded.model;
        let bs = 4;
        let g = KvGeometry {
            num_layers: m.config.num_layers,
            num_blocks: 16,
            block_size: bs,
            num_kv_heads: m.config.num_kv_heads,
            head_dim: m.config.head_dim,
        };
        let mut pool = KvPool::new(g, KvDtype::F32);
        let mut k = vec![vec![0f32; g.layer_elems()]; g.num_layers];
        let mut vc = k.clone();
        let (ta, tb) = ([9u32, 3, 12, 0], [5u32, 14, 1, 7]);
        let a: Vec<u32> = (0..13).map(|i| 20 + i * 7).collect();
        let b: Vec<u32> = (0..9).map(|i| 300 - i * 11).collect();
        // (seq a range, start), (seq b range, start): prefill a; a decodes
        // while b prefills in two chunks; then both decode.
        // (tokens, start position, block table) per chunk.
        type Chunk<'a> = (&'a [u32], usize, &'a [u32]);
        let steps: Vec<Vec<Chunk>> = vec![
            vec![(&a[..10], 0, &ta)],
            vec![(&a[10..11], 10, &ta), (&b[..5], 0, &tb)],
            vec![(&a[11..12], 11, &ta), (&b[5..8], 5, &tb)],
            vec![(&a[12..13], 12, &ta), (&b[8..9], 8, &tb)],
        ];
        for (i, st) in steps.iter().enumerate() {
            let chunks: Vec<SeqChunk> = st
                .iter()
                .map(|&(tokens, start_pos, block_table)| SeqChunk {
                    tokens,
                    start_pos,
                    block_table,
                    want_logits: true,
                })
                .collect();
            let want = v(&m.forward(&mut pool, &chunks).unwrap().unwrap());
            let step = StepBatch::new(&chunks);
            let mut rb = RefBackend {
                m,
                meta: StepMeta::build(&step, bs).unwrap(),
                k: &mut k,
                v: &mut vc,
                block_size: bs,
            };
            assert_eq!(rb.meta.is_decode, i == 3);
            let got = v(&model::forward(&m.config, &mut rb, &step).unwrap().unwrap());
            assert_eq!(got.len(), want.len());
            for (j, (x, y)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "step {i} logit {j}: {x} vs {y}"
                );
            }
            if rb.meta.is_decode {
                // The same decode step as a CUDA graph runs it: padded to a
                // bucket of 4 rows and 16-wide block tables. Padding rows
                // repeat the shortest-context row (b's, row 1: its token,
                // position and table, as `padded_inputs` repeats its id)
                // and write no KV. Real rows give the same logits, padding
                // rows row 1's, and the cache is unchanged.
                let padded = rb.meta.padded(4, 16).unwrap();
                let r = rb.meta.pad_row();
                assert_eq!(r, 1);
                let mut pchunks = chunks.clone();
                pchunks.extend((0..2).map(|_| chunks[r]));
                let pstep = StepBatch::new(&pchunks);
                let (k_before, v_before) = (k.clone(), vc.clone());
                let mut pb = RefBackend {
                    m,
                    meta: padded,
                    k: &mut k,
                    v: &mut vc,
                    block_size: bs,
                };
                let pgot = v(&model::forward(&m.config, &mut pb, &pstep).unwrap().unwrap());
                let vocab = m.config.vocab_size;
                assert_eq!(pgot.len(), 4 * vocab);
                for (j, (x, y)) in pgot[..2 * vocab].iter().zip(&want).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "padded decode logit {j}: {x} vs {y}"
                    );
                }
                let row1 = &want[vocab..2 * vocab];
                for pad in [2, 3] {
                    let got = &pgot[pad * vocab..(pad + 1) * vocab];
                    for (x, y) in got.iter().zip(row1) {
                        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "padding row {pad}");
                    }
                }
                // The real rows rewrote their own slots with the same values
                // (to rounding: a 4-row GEMM may sum in another order); the
                // padding rows wrote nothing.
                let caches = k.iter().zip(&k_before).chain(vc.iter().zip(&v_before));
                for (layer, (now, was)) in caches.enumerate() {
                    let worst = now
                        .iter()
                        .zip(was)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(worst <= 1e-5, "layer {layer}: K moved by {worst}");
                }
            }
        }
    }

    #[test]
    fn activation_reserve_grows_with_the_step() {
        let c = crate::config::preset("llama-3.1-8b").unwrap();
        let small = activation_bytes(&c, DType::Bf16, 1, 1);
        let big = activation_bytes(&c, DType::Bf16, 8192, 256);
        assert!(small >= 512 << 20);
        // 8192 tokens x (3h + 2q + 2kv + 3f) x 2 bytes alone is over 1 GiB.
        assert!(big - small > 1 << 30, "{big}");
        // The split decode's records: 512 pairs x 256 partitions (128k
        // positions) x 130 f32.
        let mut short = c.clone();
        short.max_position_embeddings = 512;
        assert_eq!(
            small - activation_bytes(&short, DType::Bf16, 1, 1),
            512 * 255 * 130 * 4
        );
    }

    /// Without a GPU, loading on CUDA is an error that names the cause.
    #[test]
    fn loading_without_a_gpu_is_an_error() {
        let src = ModelSource::parse("dummy:tiny").unwrap();
        let cfg = crate::config::preset("tiny").unwrap();
        match CudaModel::load(&src, &cfg, Precision::Bf16, 0) {
            Ok(m) => eprintln!("a GPU is present: {}", m.gpu.device.info.name),
            Err(e) => {
                let m = e.to_string();
                if envelope_cuda::libs::probe(envelope_cuda::libs::CudaLib::Driver).is_err() {
                    assert!(m.contains("libcuda.so"), "{m}");
                }
            }
        }
    }
}
