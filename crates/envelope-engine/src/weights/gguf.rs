//! GGUF files (llama.cpp's format): the model's config from the file's
//! metadata, and its tensors by llama.cpp's names.

use super::{Role, TensorSource};
use crate::config::{ModelConfig, RopeStyle};
use crate::error::{EngineError, Result};
use crate::linear::RawWeight;
use candle_core::quantized::gguf_file;
use candle_core::Device;
use std::path::{Path, PathBuf};

pub(super) fn gguf_name(role: Role, layer: usize) -> String {
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

pub(super) struct GgufSource {
    pub(super) path: PathBuf,
    pub(super) file: std::fs::File,
    pub(super) content: gguf_file::Content,
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

pub(super) fn open_gguf(path: &Path) -> Result<(std::fs::File, gguf_file::Content)> {
    let mut file = std::fs::File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| {
        EngineError::model(path.display(), format!("not a readable GGUF file: {e}"))
    })?;
    Ok((file, content))
}

pub(super) fn gguf_config(path: &Path, content: &gguf_file::Content) -> Result<ModelConfig> {
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
