//! `envelope quality`: perplexity of one precision on a fixed text, and the
//! mean KL divergence and top-1 agreement of its next-token distributions
//! against a reference precision of the same model.
//!
//! The text is tokenised once and cut into non-overlapping windows; each
//! window runs from an empty KV cache in one forward pass that returns the
//! logits of every position (each token is its own one-token chunk over the
//! shared block table: the engine writes every token's K/V before attending,
//! so position i sees exactly 0..=i). Every position but a window's last
//! predicts the next token; those predictions are scored. Windows without
//! context at their start make perplexity a little higher than a sliding
//! window would; the comparison between precisions is what the gate uses.

use envelope_engine::engine::scratch_cache;
use envelope_engine::model::{Model, SeqChunk};
use envelope_engine::{EngineError, KvDtype, LoadOptions, Precision};
use envelope_profile::QualityReport;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum QualityError {
    #[error("loading {spec} at {precision}: {source}")]
    Load {
        spec: String,
        precision: Precision,
        source: EngineError,
    },
    #[error("{0}")]
    Engine(#[from] EngineError),
    #[error("the text has {tokens} tokens: at least 2 are needed")]
    TooShort { tokens: usize },
    #[error("--window-tokens must be at least 2, got {0}")]
    Window(usize),
}

#[derive(Debug, Clone)]
pub struct QualityOptions {
    /// Tokens per window (also bounded by the model's context length).
    pub window_tokens: usize,
    /// Score at most this many windows (`None`: all).
    pub max_windows: Option<usize>,
    pub kv_dtype: KvDtype,
}

impl Default for QualityOptions {
    fn default() -> Self {
        QualityOptions {
            window_tokens: 256,
            max_windows: None,
            kv_dtype: KvDtype::F32,
        }
    }
}

/// Non-overlapping windows of `window` tokens; a tail shorter than 2 tokens
/// (nothing to predict) is dropped.
pub fn windows(tokens: &[u32], window: usize) -> Vec<&[u32]> {
    tokens
        .chunks(window.max(2))
        .filter(|w| w.len() >= 2)
        .collect()
}

/// Logits of every position of `tokens` from an empty cache: `[n][vocab]`
/// flattened, row-major.
pub fn all_position_logits(
    model: &Model,
    tokens: &[u32],
    kv_dtype: KvDtype,
) -> envelope_engine::Result<Vec<f32>> {
    let (mut kv, table) = scratch_cache(model, tokens.len(), kv_dtype);
    let chunks: Vec<SeqChunk> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| SeqChunk {
            tokens: std::slice::from_ref(t),
            start_pos: i,
            block_table: &table,
            want_logits: true,
        })
        .collect();
    match model.forward(&mut kv, &chunks)? {
        Some(t) => Ok(t.flatten_all()?.to_vec1::<f32>()?),
        None => Ok(vec![]),
    }
}

/// Natural-log softmax of one row, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// KL(p || q) from log-probabilities, nats.
pub fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            if lp.is_finite() {
                lp.exp() * (lp - lq)
            } else {
                0.0
            }
        })
        .sum::<f64>()
        .max(0.0)
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// Running sums over scored positions.
#[derive(Debug, Default, Clone)]
pub struct Scores {
    pub positions: u64,
    pub nll_sum: f64,
    pub ref_nll_sum: f64,
    pub kl: Vec<f64>,
    pub top1_same: u64,
}

impl Scores {
    /// Scores one window: `logits` (and `ref_logits`) are `[n][vocab]`.
    pub fn add_window(
        &mut self,
        window: &[u32],
        vocab: usize,
        logits: &[f32],
        ref_logits: Option<&[f32]>,
    ) {
        for i in 0..window.len() - 1 {
            let next = window[i + 1] as usize;
            let row = &logits[i * vocab..(i + 1) * vocab];
            let lp = log_softmax(row);
            self.nll_sum -= lp[next];
            if let Some(r) = ref_logits {
                let rrow = &r[i * vocab..(i + 1) * vocab];
                let lr = log_softmax(rrow);
                self.ref_nll_sum -= lr[next];
                self.kl.push(kl_divergence(&lr, &lp));
                if argmax(row) == argmax(rrow) {
                    self.top1_same += 1;
                }
            }
            self.positions += 1;
        }
    }
}

fn p95(v: &[f64]) -> f64 {
    envelope_profile::stats::nearest_rank(&mut v.to_vec(), 0.95).unwrap_or(0.0)
}

/// Measures `precision` of `spec` on `text` (named `text_set` in the
/// report), against `reference` when given.
pub fn measure(
    spec: &str,
    tokenizer: Option<std::path::PathBuf>,
    precision: Precision,
    reference: Option<Precision>,
    text_set: &str,
    text: &str,
    opts: &QualityOptions,
) -> Result<QualityReport, QualityError> {
    if opts.window_tokens < 2 {
        return Err(QualityError::Window(opts.window_tokens));
    }
    let start = Instant::now();
    let load = |p: Precision| {
        envelope_engine::load(
            spec,
            &LoadOptions {
                precision: p,
                tokenizer: tokenizer.clone(),
            },
        )
        .map_err(|source| QualityError::Load {
            spec: spec.into(),
            precision: p,
            source,
        })
    };
    let cand = load(precision)?;
    let refm = reference.map(load).transpose()?;
    let tokens = cand
        .tokenizer
        .encode(text)
        .map_err(envelope_engine::EngineError::from)?;
    if tokens.len() < 2 {
        return Err(QualityError::TooShort {
            tokens: tokens.len(),
        });
    }
    let window = opts
        .window_tokens
        .min(cand.model.config.max_position_embeddings.max(2));
    let mut ws = windows(&tokens, window);
    if let Some(m) = opts.max_windows {
        ws.truncate(m.max(1));
    }
    let vocab = cand.model.config.vocab_size;
    let mut scores = Scores::default();
    for w in &ws {
        let logits = all_position_logits(&cand.model, w, opts.kv_dtype)?;
        let ref_logits = match &refm {
            Some(r) => Some(all_position_logits(&r.model, w, opts.kv_dtype)?),
            None => None,
        };
        scores.add_window(w, vocab, &logits, ref_logits.as_deref());
    }
    let n = scores.positions.max(1) as f64;
    let mean_nll = scores.nll_sum / n;
    let with_ref = reference.is_some();
    Ok(QualityReport {
        model: spec.into(),
        precision: precision.as_str().into(),
        reference_precision: reference.map(|r| r.as_str().into()),
        text_set: text_set.into(),
        text_bytes: text.len() as u64,
        window_tokens: window as u32,
        windows: ws.len() as u32,
        tokens_scored: scores.positions,
        perplexity: mean_nll.exp(),
        mean_nll_nats: mean_nll,
        reference_perplexity: with_ref.then(|| (scores.ref_nll_sum / n).exp()),
        kl_divergence_mean: with_ref.then(|| scores.kl.iter().sum::<f64>() / n),
        kl_divergence_p95: with_ref.then(|| p95(&scores.kl)),
        top1_agreement: with_ref.then(|| scores.top1_same as f64 / n),
        duration_s: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "We hold these truths to be self-evident, that all men are created equal, \
        that they are endowed by their Creator with certain unalienable Rights, that among these \
        are Life, Liberty and the pursuit of Happiness.";

    fn opts() -> QualityOptions {
        QualityOptions {
            window_tokens: 64,
            ..Default::default()
        }
    }

    #[test]
    fn math_helpers() {
        let lp = log_softmax(&[0.0, 0.0]);
        assert!((lp[0] - 0.5f64.ln()).abs() < 1e-12);
        assert_eq!(kl_divergence(&lp, &lp), 0.0);
        let lq = log_softmax(&[0.0, 1.0]);
        // KL([.5,.5] || [1/(1+e), e/(1+e)]) = ln(0.5) - 0.5 ln(q0 q1).
        let (q0, q1) = (lq[0].exp(), lq[1].exp());
        let want = 0.5f64.ln() - 0.5 * (q0 * q1).ln();
        assert!((kl_divergence(&lp, &lq) - want).abs() < 1e-12);
        assert_eq!(windows(&[1, 2, 3, 4, 5], 2).len(), 2);
        assert_eq!(windows(&[1, 2, 3, 4, 5, 6], 3).len(), 2);
        assert_eq!(p95(&[1.0, 2.0, 3.0]), 3.0);
    }

    #[test]
    fn all_position_logits_match_prefix_logits() {
        let m = envelope_engine::load("dummy:tiny", &LoadOptions::default()).unwrap();
        let toks = m.tokenizer.encode("hello there").unwrap();
        let all = all_position_logits(&m.model, &toks, KvDtype::F32).unwrap();
        let vocab = m.model.config.vocab_size;
        for n in [1, 4, toks.len()] {
            let want =
                envelope_engine::engine::prompt_logits(&m.model, &toks[..n], KvDtype::F32).unwrap();
            let got = &all[(n - 1) * vocab..n * vocab];
            let diff = want
                .iter()
                .zip(got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-4, "prefix {n}: max diff {diff}");
        }
    }

    #[test]
    fn f32_against_itself_agrees_and_q4_0_diverges() {
        let same = measure(
            "dummy:tiny",
            None,
            Precision::F32,
            Some(Precision::F32),
            "t",
            TEXT,
            &opts(),
        )
        .unwrap();
        assert!(same.windows >= 2, "{same:?}");
        assert_eq!(
            same.tokens_scored as usize,
            TEXT.len() - same.windows as usize
        );
        assert!(same.kl_divergence_mean.unwrap().abs() < 1e-9, "{same:?}");
        assert_eq!(same.top1_agreement, Some(1.0));
        assert!(same.perplexity.is_finite() && same.perplexity > 0.0);
        assert_eq!(same.reference_perplexity, Some(same.perplexity));
        let q4 = measure(
            "dummy:tiny",
            None,
            Precision::Q4_0,
            Some(Precision::F32),
            "t",
            TEXT,
            &opts(),
        )
        .unwrap();
        assert!(q4.kl_divergence_mean.unwrap() > 0.0, "{q4:?}");
        assert!(q4.kl_divergence_p95.unwrap() >= 0.0);
        assert!(q4.perplexity.is_finite() && q4.perplexity > 0.0);
        let t = q4.top1_agreement.unwrap();
        assert!((0.0..=1.0).contains(&t));
        // Perplexity only.
        let alone = measure("dummy:tiny", None, Precision::F32, None, "t", TEXT, &opts()).unwrap();
        assert_eq!(alone.kl_divergence_mean, None);
        assert!((alone.perplexity - same.perplexity).abs() < 1e-9);
    }

    /// The real model on the bundled text (one 128-token window, seconds):
    /// q8_0 stays close to f32, q4_0 drifts further, figures are sane.
    #[test]
    fn smollm2_q8_0_is_closer_to_f32_than_q4_0() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        let model = std::env::var("ENVELOPE_TEST_MODEL")
            .unwrap_or_else(|_| format!("{root}/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        assert!(
            std::path::Path::new(&model).exists(),
            "{model} is missing: run scripts/fetch-model.sh first"
        );
        let text = std::fs::read_to_string(format!(
            "{root}/bench-configs/quality/founding-documents.txt"
        ))
        .unwrap();
        let opts = QualityOptions {
            window_tokens: 128,
            max_windows: Some(1),
            ..Default::default()
        };
        let run = |p| measure(&model, None, p, Some(Precision::F32), "t", &text, &opts).unwrap();
        let (q8, q4) = (run(Precision::Q8_0), run(Precision::Q4_0));
        assert_eq!(q8.tokens_scored, 127);
        for q in [&q8, &q4] {
            assert!(q.perplexity > 1.5 && q.perplexity < 200.0, "{q:?}");
            assert!(q.reference_perplexity.unwrap() > 1.5, "{q:?}");
        }
        let (k8, k4) = (
            q8.kl_divergence_mean.unwrap(),
            q4.kl_divergence_mean.unwrap(),
        );
        assert!(k8 > 0.0 && k8 < 0.05, "{q8:?}");
        assert!(k4 > k8, "q4_0 {k4} vs q8_0 {k8}");
        assert!(q8.top1_agreement.unwrap() > 0.85, "{q8:?}");
        assert!(q4.top1_agreement.unwrap() <= q8.top1_agreement.unwrap() + 0.05);
    }
}
