//! envelope's embedded inference engine: Llama-family models (GGUF,
//! Hugging Face safetensors, or `dummy:` presets) on the CPU, with a paged
//! KV cache, continuous or static batching, preemption by recompute, and
//! per-step statistics for the harness.

pub mod activation;
pub mod attention;
pub mod bench;
pub mod chat;
pub mod config;
pub mod cuda;
pub mod cuda_check;
pub mod cuda_report;
pub mod device;
pub mod engine;
pub mod error;
pub mod kv_cache;
pub mod linear;
pub mod load;
pub mod model;
pub mod precision;
pub mod qgemm;
pub mod sampling;
pub mod scheduler;
pub mod settings;
/// Tokenizers live in their own crate (the governor counts with them too).
pub mod tokenizer {
    pub use envelope_tokenizer::*;
}
pub mod util;
pub mod weights;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::ModelConfig;
pub use engine::{
    Engine, EngineHandle, EngineInfo, EngineMetrics, Event, FinishReason, GenerateRequest,
    StepStats,
};
pub use error::{EngineError, Result};
pub use load::{load, load_cuda, LoadOptions, LoadedCuda, LoadedModel, ModelInfo};
pub use precision::{KvDtype, Precision};
pub use sampling::SamplingParams;
pub use scheduler::{BatchPolicy, SchedulerConfig};
pub use settings::{EngineSettings, KvBudget, Placement};
pub use tokenizer::TextTokenizer;
