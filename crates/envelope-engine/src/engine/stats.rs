//! What a running engine reports: its static facts, live counters and the
//! log of its last steps.

use crate::load::ModelInfo;
use crate::precision::KvDtype;
use crate::scheduler::SchedulerConfig;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// What one step did, for the harness and the logs.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    pub step: u64,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    pub step_seconds: f64,
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub preemptions: usize,
}

/// Live counters, read by `/metrics` without stopping the loop.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub kv_blocks_used: AtomicUsize,
    pub kv_blocks_total: AtomicUsize,
    pub preemptions_total: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub generation_tokens_total: AtomicU64,
    pub requests_finished_total: AtomicU64,
    pub requests_aborted_total: AtomicU64,
    pub steps_total: AtomicU64,
    /// Steps that panicked and failed their sequences (the engine went on).
    pub step_panics_total: AtomicU64,
    /// The last steps (at most `STEP_LOG_LEN`), oldest first.
    pub step_log: Mutex<VecDeque<StepStats>>,
}

pub const STEP_LOG_LEN: usize = 4096;

impl EngineMetrics {
    pub fn kv_usage(&self) -> f64 {
        let total = self.kv_blocks_total.load(Ordering::Relaxed);
        if total == 0 {
            0.0
        } else {
            self.kv_blocks_used.load(Ordering::Relaxed) as f64 / total as f64
        }
    }
    /// Takes the step log, leaving it empty.
    pub fn drain_steps(&self) -> Vec<StepStats> {
        self.step_log
            .lock()
            .map(|mut l| l.drain(..).collect())
            .unwrap_or_default()
    }
}

/// Static facts about the running engine.
#[derive(Debug, Clone, Serialize)]
pub struct EngineInfo {
    pub model: ModelInfo,
    pub kv_dtype: KvDtype,
    pub block_size: usize,
    pub kv_blocks_total: usize,
    pub kv_bytes_per_token: usize,
    pub kv_pool_bytes: usize,
    pub kv_capacity_tokens: usize,
    pub max_model_len: usize,
    pub scheduler: SchedulerConfig,
    /// Where the model runs and on what: `cpu`, or the GPU with its kernel
    /// source, GEMM path and graph use ([`super::StepRunner::describe`]).
    pub backend: String,
}
