//! Everything needed to serve a model: weights, tokenizer, chat template,
//! and a description of what was loaded.

use crate::chat::{ChatTemplate, CHATML};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::precision::Precision;
use crate::tokenizer::TextTokenizer;
use crate::weights::{load_weights, read_meta, ModelSource, WeightReport};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub precision: Precision,
    /// A `tokenizer.json` (or GGUF file) to use instead of the model's own.
    pub tokenizer: Option<PathBuf>,
}

/// What was loaded, for logs, `/v1/models` and profiles.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    pub source: String,
    pub name: String,
    pub precision: Precision,
    pub config: ModelConfig,
    pub weights: WeightReport,
    pub file_bytes: Option<u64>,
    pub load_seconds: f64,
    pub tokenizer: String,
}

pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: TextTokenizer,
    pub chat_template: ChatTemplate,
    pub info: ModelInfo,
}

/// A model loaded on a GPU, with its tokenizer and template.
pub struct LoadedCuda {
    pub model: crate::cuda::CudaModel,
    pub tokenizer: TextTokenizer,
    pub chat_template: ChatTemplate,
    pub info: ModelInfo,
}

/// What every backend needs besides the weights.
struct Prepared {
    start: Instant,
    source: ModelSource,
    config: crate::config::ModelConfig,
    tokenizer: TextTokenizer,
    chat_template: ChatTemplate,
}

fn hf_template(dir: &std::path::Path) -> Result<Option<(String, String, String)>> {
    let path = dir.join("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| EngineError::model(path.display(), e))?;
    let tok = |k: &str| match &v[k] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    };
    let template = match &v["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(a) => a
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    };
    Ok(template.map(|t| (t, tok("bos_token"), tok("eos_token"))))
}

/// Loads `spec` for the CPU engine, in `opts.precision`.
pub fn load(spec: &str, opts: &LoadOptions) -> Result<LoadedModel> {
    let p = prepare(spec, opts)?;
    let weights = load_weights(&p.source, &p.config, opts.precision)?;
    let report = weights.report(&p.config);
    let info = p.info(spec, opts, report);
    Ok(LoadedModel {
        model: Model::new(p.config, weights),
        tokenizer: p.tokenizer,
        chat_template: p.chat_template,
        info,
    })
}

/// Loads `spec` onto CUDA device `ordinal`, in `opts.precision`
/// (`dummy:` presets are generated on the device).
pub fn load_cuda(spec: &str, opts: &LoadOptions, ordinal: usize) -> Result<LoadedCuda> {
    let p = prepare(spec, opts)?;
    let model = crate::cuda::CudaModel::load(&p.source, &p.config, opts.precision, ordinal)?;
    let info = p.info(spec, opts, model.report.clone());
    Ok(LoadedCuda {
        model,
        tokenizer: p.tokenizer,
        chat_template: p.chat_template,
        info,
    })
}

impl Prepared {
    fn info(&self, spec: &str, opts: &LoadOptions, weights: WeightReport) -> ModelInfo {
        ModelInfo {
            source: spec.to_string(),
            name: self.source.display_name(),
            precision: opts.precision,
            config: self.config.clone(),
            weights,
            file_bytes: match &self.source {
                ModelSource::Gguf(p) => std::fs::metadata(p).ok().map(|m| m.len()),
                _ => None,
            },
            load_seconds: self.start.elapsed().as_secs_f64(),
            tokenizer: if self.tokenizer.is_byte_fallback() {
                "bytes".into()
            } else {
                "bpe".into()
            },
        }
    }
}

fn prepare(spec: &str, opts: &LoadOptions) -> Result<Prepared> {
    let start = Instant::now();
    let source = ModelSource::parse(spec)?;
    let meta = read_meta(&source)?;
    let config = meta.config.clone();

    let mut tokenizer = match (&opts.tokenizer, &meta.gguf, &meta.hf_dir) {
        (Some(p), _, _) if p.extension().is_some_and(|e| e == "gguf") => {
            let mut f = std::fs::File::open(p).map_err(|source| EngineError::Io {
                path: p.clone(),
                source,
            })?;
            let c = candle_core::quantized::gguf_file::Content::read(&mut f)
                .map_err(|e| EngineError::model(p.display(), e))?;
            TextTokenizer::from_gguf(p, &c)?
        }
        (Some(p), _, _) => TextTokenizer::from_file(p)?,
        (None, Some((p, c)), _) => TextTokenizer::from_gguf(p, c)?,
        (None, None, Some(dir)) => TextTokenizer::from_file(&dir.join("tokenizer.json"))?,
        (None, None, None) => TextTokenizer::bytes(config.vocab_size),
    };
    let _ = &mut tokenizer;
    let tok_name = |id: Option<u32>| {
        id.and_then(|i| tokenizer.id_to_token(i))
            .unwrap_or_default()
    };
    let (template, bos, eos) = match (&meta.gguf, &meta.hf_dir) {
        (Some((_, c)), _) => (
            c.metadata
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok())
                .cloned(),
            tok_name(config.bos_token_id),
            tok_name(config.eos_token_ids.first().copied()),
        ),
        (_, Some(dir)) => match hf_template(dir)? {
            Some((t, b, e)) => (Some(t), b, e),
            None => (
                None,
                tok_name(config.bos_token_id),
                tok_name(config.eos_token_ids.first().copied()),
            ),
        },
        _ => (
            None,
            tok_name(config.bos_token_id),
            tok_name(config.eos_token_ids.first().copied()),
        ),
    };
    let chat_template = ChatTemplate::new(template.as_deref().unwrap_or(CHATML), &bos, &eos)?;

    Ok(Prepared {
        start,
        source,
        config,
        tokenizer,
        chat_template,
    })
}
