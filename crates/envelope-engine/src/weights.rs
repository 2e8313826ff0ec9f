//! Loading weights from the three sources (GGUF file, Hugging Face directory,
//! `dummy:` preset) into one in-memory layout, converted to the precision
//! asked for. Each source only knows how to hand over a named tensor; the
//! layout below is shared.

use crate::config::{self, ModelConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::linear::{Linear, Matrix, RawWeight};
use crate::precision::Precision;
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Gguf(PathBuf),
    HfDir(PathBuf),
    Dummy { preset: String, seed: u64 },
}

impl ModelSource {
    /// `dummy:<preset>[@seed]`, a directory, or a `.gguf` file.
    pub fn parse(spec: &str) -> Result<ModelSource> {
        if let Some(rest) = spec.strip_prefix("dummy:") {
            let (preset, seed) = match rest.split_once('@') {
                Some((p, s)) => (
                    p,
                    s.parse::<u64>().map_err(|_| EngineError::InvalidSetting {
                        field: "model",
                        message: format!("dummy seed `{s}` is not an integer"),
                    })?,
                ),
                None => (rest, 0),
            };
            config::preset(preset)?;
            return Ok(ModelSource::Dummy {
                preset: preset.to_string(),
                seed,
            });
        }
        let path = PathBuf::from(spec);
        if path.is_dir() {
            Ok(ModelSource::HfDir(path))
        } else if path.is_file() {
            Ok(ModelSource::Gguf(path))
        } else {
            Err(EngineError::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no such file or directory (expected a .gguf file, a Hugging Face model directory or dummy:<preset>)",
                ),
            })
        }
    }

    /// A short name for the model, used as the served model id by default.
    pub fn display_name(&self) -> String {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p
                .file_name()
                .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
                .unwrap_or_else(|| p.display().to_string()),
            ModelSource::Dummy { preset, .. } => format!("dummy:{preset}"),
        }
    }
}

/// One transformer block.
pub struct LayerWeights {
    pub attn_norm: Tensor,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub ffn_norm: Tensor,
    pub w_gate: Linear,
    pub w_up: Linear,
    pub w_down: Linear,
}

pub struct ModelWeights {
    pub embedding: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Linear,
    pub tied: bool,
}

/// What the loaded weights occupy, by part.
#[derive(Debug, Clone, Serialize)]
pub struct WeightReport {
    pub total_bytes: usize,
    pub embedding_bytes: usize,
    pub layers_bytes: usize,
    pub lm_head_bytes: usize,
    pub num_parameters: usize,
    /// Storage formats seen, e.g. `["q4_1", "q8_0", "f32"]`.
    pub formats: Vec<String>,
}

impl ModelWeights {
    pub fn report(&self, cfg: &ModelConfig) -> WeightReport {
        let norm = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let layers_bytes: usize = self
            .layers
            .iter()
            .map(|l| {
                norm(&l.attn_norm)
                    + norm(&l.ffn_norm)
                    + [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                        .iter()
                        .map(|w| w.bytes())
                        .sum::<usize>()
            })
            .sum();
        let embedding_bytes = self.embedding.bytes();
        let lm_head_bytes = if self.tied { 0 } else { self.lm_head.bytes() };
        let mut formats: Vec<String> = Vec::new();
        let mut see = |f: String| {
            if !formats.contains(&f) {
                formats.push(f)
            }
        };
        see(self.embedding.format());
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                see(w.weight().format());
            }
        }
        see(self.lm_head.weight().format());
        WeightReport {
            total_bytes: embedding_bytes + layers_bytes + lm_head_bytes + norm(&self.final_norm),
            embedding_bytes,
            layers_bytes,
            lm_head_bytes,
            num_parameters: cfg.num_parameters(),
            formats,
        }
    }
}

/// Canonical tensor roles; each source maps them to its own names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Embedding,
    FinalNorm,
    LmHead,
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    FfnNorm,
    Gate,
    Up,
    Down,
}

fn gguf_name(role: Role, layer: usize) -> String {
    let l = |s: &str| format!("blk.{layer}.{s}");
    match role {
        Role::Embedding => "token_embd.weight".into(),
        Role::FinalNorm => "output_norm.weight".into(),
        Role::LmHead => "output.weight".into(),
        Role::AttnNorm => l("attn_norm.weight"),
        Role::Q => l("attn_q.weight"),
        Role::K => l("attn_k.weight"),
        Role::V => l("attn_v.weight"),
        Role::O => l("attn_output.weight"),
        Role::QBias => l("attn_q.bias"),
        Role::KBias => l("attn_k.bias"),
        Role::VBias => l("attn_v.bias"),
        Role::FfnNorm => l("ffn_norm.weight"),
        Role::Gate => l("ffn_gate.weight"),
        Role::Up => l("ffn_up.weight"),
        Role::Down => l("ffn_down.weight"),
    }
}

pub(crate) fn hf_name(role: Role, layer: usize) -> String {
    let l = |s: &str| format!("model.layers.{layer}.{s}");
    match role {
        Role::Embedding => "model.embed_tokens.weight".into(),
        Role::FinalNorm => "model.norm.weight".into(),
        Role::LmHead => "lm_head.weight".into(),
        Role::AttnNorm => l("input_layernorm.weight"),
        Role::Q => l("self_attn.q_proj.weight"),
        Role::K => l("self_attn.k_proj.weight"),
        Role::V => l("self_attn.v_proj.weight"),
        Role::O => l("self_attn.o_proj.weight"),
        Role::QBias => l("self_attn.q_proj.bias"),
        Role::KBias => l("self_attn.k_proj.bias"),
        Role::VBias => l("self_attn.v_proj.bias"),
        Role::FfnNorm => l("post_attention_layernorm.weight"),
        Role::Gate => l("mlp.gate_proj.weight"),
        Role::Up => l("mlp.up_proj.weight"),
        Role::Down => l("mlp.down_proj.weight"),
    }
}

/// Hands over tensors by role. `Ok(None)` means "not in this source".
trait TensorSource {
    fn get(&mut self, role: Role, layer: usize) -> Result<Option<RawWeight>>;
    fn name(&self) -> String;
}

struct GgufSource {
    path: PathBuf,
    file: std::fs::File,
    content: gguf_file::Content,
}

impl TensorSource for GgufSource {
    fn get(&mut self, role: Role, layer: usize) -> Result<Option<RawWeight>> {
        let name = gguf_name(role, layer);
        if !self.content.tensor_infos.contains_key(&name) {
            return Ok(None);
        }
        let q = self
            .content
            .tensor(&mut self.file, &name, &Device::Cpu)
            .map_err(|e| EngineError::model(self.path.display(), format!("tensor {name}: {e}")))?;
        Ok(Some(RawWeight::Quant(q)))
    }
    fn name(&self) -> String {
        self.path.display().to_string()
    }
}

struct HfSource {
    dir: PathBuf,
    st: candle_core::safetensors::MmapedSafetensors,
}

impl TensorSource for HfSource {
    fn get(&mut self, role: Role, layer: usize) -> Result<Option<RawWeight>> {
        let name = hf_name(role, layer);
        match self.st.load(&name, &Device::Cpu) {
            Ok(t) => Ok(Some(RawWeight::Dense(t))),
            Err(_) if self.st.get(&name).is_err() => Ok(None),
            Err(e) => Err(EngineError::model(
                self.dir.display(),
                format!("tensor {name}: {e}"),
            )),
        }
    }
    fn name(&self) -> String {
        self.dir.display().to_string()
    }
}

/// Deterministic random weights: every element is a counter-based hash of
/// (seed, tensor name, index), so any backend can regenerate them
/// identically without shipping files.
struct DummySource {
    cfg: ModelConfig,
    preset: String,
    seed: u64,
}

pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
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

/// Metadata and tokenizer material a source carries besides the weights.
pub struct SourceMeta {
    pub config: ModelConfig,
    pub gguf: Option<(PathBuf, gguf_file::Content)>,
    pub hf_dir: Option<PathBuf>,
}

fn open_gguf(path: &Path) -> Result<(std::fs::File, gguf_file::Content)> {
    let mut file = std::fs::File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| {
        EngineError::model(path.display(), format!("not a readable GGUF file: {e}"))
    })?;
    Ok((file, content))
}

fn gguf_config(path: &Path, content: &gguf_file::Content) -> Result<ModelConfig> {
    let md = &content.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| "llama".into());
    if arch != "llama" && arch != "qwen2" {
        return Err(EngineError::model(
            path.display(),
            format!("architecture `{arch}` is not supported (llama and qwen2 are)"),
        ));
    }
    let get = |k: &str| -> Result<&gguf_file::Value> {
        md.get(&format!("{arch}.{k}")).ok_or_else(|| {
            EngineError::model(path.display(), format!("metadata {arch}.{k} is missing"))
        })
    };
    let u = |k: &str| -> Result<usize> {
        get(k)?
            .to_u32()
            .map(|v| v as usize)
            .map_err(|e| EngineError::model(path.display(), format!("{arch}.{k}: {e}")))
    };
    let hidden = u("embedding_length")?;
    let heads = u("attention.head_count")?;
    let vocab = md
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.to_vec().ok())
        .map(|v| v.len())
        .or_else(|| {
            content
                .tensor_infos
                .get("token_embd.weight")
                .map(|t| t.shape.dims()[0])
        })
        .ok_or_else(|| EngineError::model(path.display(), "cannot tell the vocabulary size"))?;
    let tok_u32 = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
    let mut eos = Vec::new();
    if let Some(e) = tok_u32("tokenizer.ggml.eos_token_id") {
        eos.push(e);
    }
    if let Some(e) = tok_u32("tokenizer.ggml.eot_token_id") {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    let cfg = ModelConfig {
        architecture: arch.clone(),
        num_layers: u("block_count")?,
        hidden_size: hidden,
        num_heads: heads,
        num_kv_heads: u("attention.head_count_kv").unwrap_or(heads),
        head_dim: u("rope.dimension_count").unwrap_or(hidden / heads),
        intermediate_size: u("feed_forward_length")?,
        vocab_size: vocab,
        max_position_embeddings: u("context_length").unwrap_or(4096),
        rope_theta: get("rope.freq_base")
            .and_then(|v| {
                v.to_f32()
                    .map_err(|e| EngineError::model(path.display(), e))
            })
            .unwrap_or(10_000.0),
        rms_norm_eps: get("attention.layer_norm_rms_epsilon")
            .and_then(|v| {
                v.to_f32()
                    .map_err(|e| EngineError::model(path.display(), e))
            })
            .unwrap_or(1e-5) as f64,
        // llama.cpp stores llama Q/K permuted for interleaved RoPE; qwen2 uses neox.
        rope_style: if arch == "llama" {
            RopeStyle::Interleaved
        } else {
            RopeStyle::HalfSplit
        },
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        attention_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        bos_token_id: tok_u32("tokenizer.ggml.bos_token_id"),
        eos_token_ids: eos,
    };
    cfg.validate()?;
    Ok(cfg)
}

#[derive(serde::Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: Option<String>,
    num_hidden_layers: usize,
    hidden_size: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    intermediate_size: usize,
    vocab_size: usize,
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    rope_theta: Option<f32>,
    #[serde(default)]
    rms_norm_eps: Option<f64>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
}

fn hf_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| EngineError::Io {
        path: path.clone(),
        source,
    })?;
    let c: HfConfig =
        serde_json::from_str(&text).map_err(|e| EngineError::model(path.display(), e))?;
    let arch = c.model_type.unwrap_or_else(|| "llama".into());
    let eos = match c.eos_token_id {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64().map(|v| v as u32))
            .collect(),
        _ => vec![],
    };
    let cfg = ModelConfig {
        attention_bias: c.attention_bias.unwrap_or(arch == "qwen2"),
        architecture: arch,
        num_layers: c.num_hidden_layers,
        hidden_size: c.hidden_size,
        num_heads: c.num_attention_heads,
        num_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
        head_dim: c
            .head_dim
            .unwrap_or(c.hidden_size / c.num_attention_heads.max(1)),
        intermediate_size: c.intermediate_size,
        vocab_size: c.vocab_size,
        max_position_embeddings: c.max_position_embeddings.unwrap_or(4096),
        rope_theta: c.rope_theta.unwrap_or(10_000.0),
        rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-5),
        rope_style: RopeStyle::HalfSplit,
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
        bos_token_id: c.bos_token_id,
        eos_token_ids: eos,
    };
    cfg.validate()
        .map_err(|e| EngineError::model(path.display(), e))?;
    Ok(cfg)
}

/// Reads the source's metadata (no weights yet).
pub fn read_meta(source: &ModelSource) -> Result<SourceMeta> {
    match source {
        ModelSource::Gguf(path) => {
            let (_, content) = open_gguf(path)?;
            let config = gguf_config(path, &content)?;
            Ok(SourceMeta {
                config,
                gguf: Some((path.clone(), content)),
                hf_dir: None,
            })
        }
        ModelSource::HfDir(dir) => Ok(SourceMeta {
            config: hf_config(dir)?,
            gguf: None,
            hf_dir: Some(dir.clone()),
        }),
        ModelSource::Dummy { preset, .. } => Ok(SourceMeta {
            config: config::preset(preset)?,
            gguf: None,
            hf_dir: None,
        }),
    }
}

/// Loads every weight of `source`, converted to `precision`.
pub fn load_weights(
    source: &ModelSource,
    cfg: &ModelConfig,
    precision: Precision,
) -> Result<ModelWeights> {
    let mut src: Box<dyn TensorSource> = match source {
        ModelSource::Gguf(path) => {
            let (file, content) = open_gguf(path)?;
            Box::new(GgufSource {
                path: path.clone(),
                file,
                content,
            })
        }
        ModelSource::HfDir(dir) => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|source| EngineError::Io {
                    path: dir.clone(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(EngineError::model(dir.display(), "no *.safetensors files"));
            }
            // SAFETY: the files are mapped read-only and not modified while loaded.
            let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }
                .map_err(|e| EngineError::model(dir.display(), e))?;
            Box::new(HfSource {
                dir: dir.clone(),
                st,
            })
        }
        ModelSource::Dummy { preset, seed } => Box::new(DummySource {
            cfg: cfg.clone(),
            preset: preset.clone(),
            seed: *seed,
        }),
    };
    let name = src.name();
    let need = |src: &mut Box<dyn TensorSource>, role: Role, layer: usize| -> Result<RawWeight> {
        src.get(role, layer)?.ok_or_else(|| {
            EngineError::model(
                &name,
                format!(
                    "missing tensor {} / {}",
                    gguf_name(role, layer),
                    hf_name(role, layer)
                ),
            )
        })
    };
    let check = |w: &RawWeight, want: &[usize], role: Role, layer: usize| -> Result<()> {
        if w.shape() != want {
            return Err(EngineError::model(
                src_name_for(source),
                format!(
                    "tensor {} has shape {:?}, the config implies {:?}",
                    hf_name(role, layer),
                    w.shape(),
                    want
                ),
            ));
        }
        Ok(())
    };
    let norm = |w: RawWeight| -> Result<Tensor> { w.to_f32() };
    let (h, qd, kvd, f) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    let matrix = |src: &mut Box<dyn TensorSource>,
                  role: Role,
                  layer: usize,
                  shape: [usize; 2]|
     -> Result<Matrix> {
        let w = need(src, role, layer)?;
        check(&w, &shape, role, layer)?;
        Matrix::convert(w, precision)
    };
    // fp8 keeps the embedding and the LM head in bf16 (as the CUDA path and
    // vLLM do): only the layer matrices are e4m3.
    let head_precision = if precision == Precision::Fp8 {
        Precision::Bf16
    } else {
        precision
    };
    let embedding = {
        let w = need(&mut src, Role::Embedding, 0)?;
        check(&w, &[cfg.vocab_size, h], Role::Embedding, 0)?;
        Matrix::convert(w, head_precision)?
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let bias = |src: &mut Box<dyn TensorSource>, role: Role| -> Result<Option<Tensor>> {
            Ok(match src.get(role, i)? {
                Some(b) => Some(b.to_f32()?),
                None => None,
            })
        };
        let wq = Linear::new(
            matrix(&mut src, Role::Q, i, [qd, h])?,
            bias(&mut src, Role::QBias)?,
        );
        let wk = Linear::new(
            matrix(&mut src, Role::K, i, [kvd, h])?,
            bias(&mut src, Role::KBias)?,
        );
        let wv = Linear::new(
            matrix(&mut src, Role::V, i, [kvd, h])?,
            bias(&mut src, Role::VBias)?,
        );
        let wo = Linear::new(matrix(&mut src, Role::O, i, [h, qd])?, None);
        let w_gate = Linear::new(matrix(&mut src, Role::Gate, i, [f, h])?, None);
        let w_up = Linear::new(matrix(&mut src, Role::Up, i, [f, h])?, None);
        let w_down = Linear::new(matrix(&mut src, Role::Down, i, [h, f])?, None);
        layers.push(LayerWeights {
            attn_norm: norm(need(&mut src, Role::AttnNorm, i)?)?,
            ffn_norm: norm(need(&mut src, Role::FfnNorm, i)?)?,
            wq,
            wk,
            wv,
            wo,
            w_gate,
            w_up,
            w_down,
        });
    }
    let final_norm = norm(need(&mut src, Role::FinalNorm, 0)?)?;
    let (lm_head, tied) = match src.get(Role::LmHead, 0)? {
        Some(w) if !cfg.tie_word_embeddings || matches!(source, ModelSource::HfDir(_)) => {
            check(&w, &[cfg.vocab_size, h], Role::LmHead, 0)?;
            (
                Linear::new(Matrix::convert(w, head_precision)?, None),
                false,
            )
        }
        _ => (Linear::new(embedding.clone(), None), true),
    };
    Ok(ModelWeights {
        embedding,
        layers,
        final_norm,
        lm_head,
        tied,
    })
}

fn src_name_for(source: &ModelSource) -> String {
    match source {
        ModelSource::Gguf(p) | ModelSource::HfDir(p) => p.display().to_string(),
        ModelSource::Dummy { preset, seed } => format!("dummy:{preset}@{seed}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dummy_values_are_deterministic_and_bounded() {
        let a = dummy_values(7, "w", 100_000, 0.5);
        let b = dummy_values(7, "w", 100_000, 0.5);
        let c = dummy_values(8, "w", 100_000, 0.5);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|v| (-0.5..0.5).contains(v)));
        let mean: f32 = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.01, "mean {mean}");
    }

    /// The GPU generates dummy weights with kernels/dummy.cu, checked on a
    /// GPU against envelope_cuda::reference::dummy_fill; here that
    /// reference is checked against the CPU's values (rounded to bf16, as
    /// the dummy source stores them), so CPU and GPU hold the same model.
    #[test]
    fn the_gpu_reference_of_dummy_weights_is_the_cpu_generator() {
        let (seed, name) = (3, "model.layers.7.mlp.up_proj.weight");
        let cpu: Vec<f32> = dummy_values(seed, name, 200_000, 0.04)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let gpu_ref = envelope_cuda::reference::dummy_fill(dummy_key(seed, name), 200_000, 0.04);
        assert_eq!(cpu, gpu_ref);
        assert_ne!(
            gpu_ref,
            envelope_cuda::reference::dummy_fill(dummy_key(seed + 1, name), 200_000, 0.04)
        );
    }

    #[test]
    fn parse_sources() {
        assert_eq!(
            ModelSource::parse("dummy:tiny@3").unwrap(),
            ModelSource::Dummy {
                preset: "tiny".into(),
                seed: 3
            }
        );
        assert!(ModelSource::parse("dummy:gpt-9").is_err());
        let err = ModelSource::parse("/no/such/model.gguf")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/no/such/model.gguf"), "{err}");
    }
}
