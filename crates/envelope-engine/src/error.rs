//! The engine's one error type. Variants carry the field or file they are
//! about, so the CLI and the server can say exactly what went wrong.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read model {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("model {path}: {message}")]
    Model { path: String, message: String },
    #[error("unknown dummy preset `{0}` (known: {1})")]
    UnknownPreset(String, String),
    #[error("invalid setting `{field}`: {message}")]
    InvalidSetting {
        field: &'static str,
        message: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of {max_model_len} tokens")]
    ContextLengthExceeded {
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    #[error("invalid request: {param}: {message}")]
    InvalidRequest {
        param: &'static str,
        message: String,
    },
    #[error("the request needs {needed_blocks} KV blocks but the whole pool has {total_blocks}")]
    KvPoolTooSmall {
        needed_blocks: usize,
        total_blocks: usize,
    },
    #[error("the engine has shut down")]
    ShutDown,
    #[error("an engine step panicked ({message}); its {failed} sequences failed")]
    StepPanicked { message: String, failed: usize },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Cuda(#[from] envelope_cuda::CudaError),
    /// `--device cuda` without a usable device.
    #[error(transparent)]
    Device(#[from] envelope_cuda::SelectError),
}

impl EngineError {
    pub fn model(path: impl std::fmt::Display, message: impl std::fmt::Display) -> Self {
        EngineError::Model {
            path: path.to_string(),
            message: message.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

impl From<envelope_tokenizer::TokenizerError> for EngineError {
    fn from(e: envelope_tokenizer::TokenizerError) -> EngineError {
        EngineError::Tokenizer(e.0)
    }
}
