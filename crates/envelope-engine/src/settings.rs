//! How an engine is built: the KV pool, the batch policy, the context.
//! Both backends (CPU and CUDA) take this one configuration.

use crate::precision::KvDtype;
use crate::scheduler::SchedulerConfig;

/// How big the KV pool is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    Bytes(usize),
    /// A fraction of the host's available memory after the weights are loaded.
    FractionOfAvailable(f64),
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub kv_dtype: KvDtype,
    pub kv_budget: KvBudget,
    pub block_size: usize,
    pub scheduler: SchedulerConfig,
    /// Longest sequence (prompt + output) accepted; defaults to the model's context.
    pub max_model_len: Option<usize>,
    /// Test aid: each step also sleeps this many ms per sequence it
    /// computes, so the engine acts like a slower, compute-bound device
    /// (latency grows with the batch). 0 in real use.
    pub slow_step_ms_per_seq: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kv_dtype: KvDtype::F32,
            kv_budget: KvBudget::FractionOfAvailable(0.2),
            block_size: 16,
            scheduler: SchedulerConfig::default(),
            max_model_len: None,
            slow_step_ms_per_seq: 0,
        }
    }
}
