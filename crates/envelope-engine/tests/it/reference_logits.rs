//! Our forward pass against candle-transformers' `quantized_llama` on the
//! same SmolLM2 GGUF and prompt.
//!
//! Two comparisons, with tolerances stated:
//! - weights dequantised to f32 on both sides (candle's
//!   `CANDLE_DEQUANTIZE_ALL`): the same arithmetic up to summation order, so
//!   max |diff| <= 1e-4 x max |logit|;
//! - weights as stored (Q4_1 blocks, activations quantised to Q8 inside the
//!   matmul on both sides): a 1e-6 difference in an activation can flip the
//!   rounding of an 8-bit value, so the two drift apart through 30 layers;
//!   we require the same argmax, cosine similarity >= 0.998,
//!   max |diff| <= 5% of max |logit|, and the same 16 greedy tokens.

use crate::common;

use candle_core::{Device, Tensor};
use envelope_engine::engine::prompt_logits;
use envelope_engine::*;

const PROMPT: &str = "The quick brown fox jumps over the lazy dog. In the beginning";

struct Diff {
    greedy: (Vec<u32>, Vec<u32>),
    max_abs: f32,
    scale: f32,
    cosine: f64,
    same_argmax: bool,
}

/// Runs both models on a fresh thread: candle reads CANDLE_DEQUANTIZE_ALL
/// once per thread.
fn compare(precision: Precision) -> Diff {
    std::thread::spawn(move || {
        let path = common::smollm2_path();
        let mut f = std::fs::File::open(&path).unwrap();
        let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
        let mut reference = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
            content,
            &mut f,
            &Device::Cpu,
        )
        .unwrap();
        let ours = load(
            path.to_str().unwrap(),
            &LoadOptions {
                precision,
                ..Default::default()
            },
        )
        .unwrap();
        let prompt = ours.tokenizer.encode(PROMPT).unwrap();
        let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let want: Vec<f32> = reference
            .forward(&input, 0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        let got = prompt_logits(&ours.model, &prompt, KvDtype::F32).unwrap();
        // 16 greedy tokens from each.
        let mut ref_tokens = vec![];
        let mut logits = want.clone();
        for i in 0..16 {
            let t = logits
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            ref_tokens.push(t);
            let x = Tensor::new(&[t], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            logits = reference
                .forward(&x, prompt.len() + i)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1()
                .unwrap();
        }
        let h = EngineHandle::spawn(
            ours,
            &EngineSettings {
                kv_budget: KvBudget::Bytes(16 << 20),
                ..Default::default()
            },
        )
        .unwrap();
        let our_tokens = h
            .generate_blocking(GenerateRequest {
                prompt_tokens: prompt.clone(),
                params: SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(16)
                },
            })
            .unwrap()
            .tokens;
        assert_eq!(want.len(), got.len());
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        let dot: f64 = want
            .iter()
            .zip(&got)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum();
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        Diff {
            greedy: (ref_tokens, our_tokens),
            max_abs: want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max),
            scale: want.iter().map(|a| a.abs()).fold(0f32, f32::max),
            cosine: dot / (norm(&want) * norm(&got)),
            same_argmax: argmax(&want) == argmax(&got),
        }
    })
    .join()
    .unwrap()
}

#[test]
fn logits_match_candle_transformers_quantized_llama() {
    let q = compare(Precision::AsStored);
    eprintln!(
        "as stored: max|diff| {} of max|logit| {}, cosine {}",
        q.max_abs, q.scale, q.cosine
    );
    assert!(q.same_argmax);
    assert!(q.cosine >= 0.998, "cosine {}", q.cosine);
    assert_eq!(q.greedy.0, q.greedy.1, "greedy continuations differ");
    assert!(
        q.max_abs <= 0.05 * q.scale,
        "max |diff| {} vs max |logit| {}",
        q.max_abs,
        q.scale
    );

    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let f = compare(Precision::F32);
    eprintln!(
        "f32: max|diff| {} of max|logit| {}, cosine {}",
        f.max_abs, f.scale, f.cosine
    );
    assert!(f.same_argmax);
    assert_eq!(f.greedy.0, f.greedy.1, "greedy continuations differ");
    assert!(
        f.max_abs <= 1e-4 * f.scale,
        "max |diff| {} vs max |logit| {}",
        f.max_abs,
        f.scale
    );
}
