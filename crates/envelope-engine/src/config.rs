//! Model shape and the `dummy:` presets (published shapes of real models,
//! filled with deterministic random weights, like vLLM's dummy load format).

use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};

/// How RoPE pairs the dimensions of a head. GGUF files of the llama
/// architecture store Q/K permuted for the interleaved form (as llama.cpp
/// computes it); Hugging Face checkpoints use the half-split ("neox") form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    Interleaved,
    HalfSplit,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f64,
    pub rope_style: RopeStyle,
    pub tie_word_embeddings: bool,
    /// Q/K/V projections carry a bias (Qwen2).
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, message: String| {
            Err(EngineError::InvalidSetting { field, message })
        };
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad(
                "config",
                "num_layers, hidden_size and vocab_size must be > 0".into(),
            );
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(
                "num_kv_heads",
                format!(
                    "num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                    self.num_heads, self.num_kv_heads
                ),
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!("must be even and > 0, got {}", self.head_dim),
            );
        }
        Ok(())
    }

    /// KV-cache bytes per token for an element size (both K and V, all layers):
    /// 2 x layers x kv_heads x head_dim x bytes, the figure trtllm-bench uses.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes
    }

    /// Number of weight parameters implied by the shape.
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let mut per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h;
        if self.attention_bias {
            per_layer += q + 2 * kv;
        }
        let emb = self.vocab_size * h;
        let out = if self.tie_word_embeddings { 0 } else { emb };
        emb + out + self.num_layers * per_layer + h
    }
}

pub const PRESETS: &[&str] = &[
    "tiny",
    "tiny-hd32",
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "qwen2.5-7b",
];

/// The published shape of a known model (from its `config.json`).
pub fn preset(name: &str) -> Result<ModelConfig> {
    #[allow(clippy::too_many_arguments)]
    fn shape(
        arch: &str,
        layers: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        ffn: usize,
        vocab: usize,
        ctx: usize,
        theta: f32,
        eps: f64,
        tied: bool,
    ) -> ModelConfig {
        ModelConfig {
            architecture: arch.to_string(),
            num_layers: layers,
            hidden_size: hidden,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: hidden / heads,
            intermediate_size: ffn,
            vocab_size: vocab,
            max_position_embeddings: ctx,
            rope_theta: theta,
            rms_norm_eps: eps,
            rope_style: RopeStyle::HalfSplit,
            tie_word_embeddings: tied,
            attention_bias: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        }
    }
    let cfg = match name {
        "tiny" => shape("llama", 2, 64, 4, 2, 128, 512, 2048, 10_000.0, 1e-5, true),
        // tiny with head_dim 32, the smallest the CUDA attention kernels
        // take, and its own LM head: tied embeddings make a dummy model
        // repeat its last token, so greedy runs would not show a wrong step
        // (for the CPU-emulated GPU runs in CI).
        "tiny-hd32" => shape("llama", 2, 128, 4, 2, 256, 512, 2048, 10_000.0, 1e-5, false),
        "smollm2-135m" => shape(
            "llama", 30, 576, 9, 3, 1536, 49152, 8192, 100_000.0, 1e-5, true,
        ),
        "llama-3.2-1b" => shape(
            "llama", 16, 2048, 32, 8, 8192, 128_256, 131_072, 500_000.0, 1e-5, true,
        ),
        "llama-3.1-8b" => shape(
            "llama", 32, 4096, 32, 8, 14336, 128_256, 131_072, 500_000.0, 1e-5, false,
        ),
        "qwen2.5-7b" => {
            let mut c = shape(
                "qwen2",
                28,
                3584,
                28,
                4,
                18944,
                152_064,
                32_768,
                1_000_000.0,
                1e-6,
                false,
            );
            c.attention_bias = true;
            c
        }
        other => {
            return Err(EngineError::UnknownPreset(
                other.to_string(),
                PRESETS.join(", "),
            ))
        }
    };
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_published_sizes() {
        // Parameter counts from the model cards, to within rounding.
        let p = |n: &str| preset(n).unwrap().num_parameters() as f64 / 1e9;
        assert!(
            (p("smollm2-135m") - 0.1346).abs() < 0.001,
            "{}",
            p("smollm2-135m")
        );
        assert!(
            (p("llama-3.2-1b") - 1.236).abs() < 0.01,
            "{}",
            p("llama-3.2-1b")
        );
        assert!(
            (p("llama-3.1-8b") - 8.03).abs() < 0.01,
            "{}",
            p("llama-3.1-8b")
        );
        assert!((p("qwen2.5-7b") - 7.62).abs() < 0.01, "{}", p("qwen2.5-7b"));
        assert!(preset("nope").is_err());
        for n in PRESETS {
            preset(n).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn kv_bytes_per_token_matches_the_llama_8b_figure() {
        // 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 128 KiB.
        assert_eq!(
            preset("llama-3.1-8b").unwrap().kv_bytes_per_token(2),
            128 * 1024
        );
    }
}
