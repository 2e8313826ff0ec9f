//! Loading weights from the three sources (GGUF file, Hugging Face directory,
//! `dummy:` preset) into one in-memory layout, converted to the precision
//! asked for. Each source only knows how to hand over a named tensor; the
//! layout below is shared.

use crate::config::{self, ModelConfig};
use crate::error::{EngineError, Result};
use crate::linear::{Linear, Matrix, RawWeight};
use crate::precision::Precision;
use candle_core::quantized::gguf_file;
use candle_core::Tensor;
use serde::Serialize;
use std::path::PathBuf;

mod dummy;
mod gguf;
mod hf;
use dummy::DummySource;
pub(crate) use dummy::{dummy_init, DummyInit};
pub use dummy::{dummy_key, dummy_values, splitmix64};
use gguf::{gguf_config, gguf_name, open_gguf, GgufSource};
pub(crate) use hf::hf_name;
use hf::{hf_config, HfSource};

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

/// Hands over tensors by role. `Ok(None)` means "not in this source".
trait TensorSource {
    fn get(&mut self, role: Role, layer: usize) -> Result<Option<RawWeight>>;
    fn name(&self) -> String;
}

/// Metadata and tokenizer material a source carries besides the weights.
pub struct SourceMeta {
    pub config: ModelConfig,
    pub gguf: Option<(PathBuf, gguf_file::Content)>,
    pub hf_dir: Option<PathBuf>,
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
