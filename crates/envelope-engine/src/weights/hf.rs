//! Hugging Face directories: `config.json` and `*.safetensors`, tensors by
//! the transformers names.

use super::{Role, TensorSource};
use crate::config::{ModelConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::linear::RawWeight;
use candle_core::Device;
use std::path::{Path, PathBuf};

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

pub(super) struct HfSource {
    pub(super) dir: PathBuf,
    pub(super) st: candle_core::safetensors::MmapedSafetensors,
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

#[derive(serde::Deserialize)]
pub(super) struct HfConfig {
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

pub(super) fn hf_config(dir: &Path) -> Result<ModelConfig> {
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
