//! How an engine is built: the KV pool, the batch policy, the context.
//! Both backends (CPU and CUDA) take this one configuration.

use crate::error::{EngineError, Result};
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
pub struct EngineSettings {
    pub kv_dtype: KvDtype,
    pub kv_budget: KvBudget,
    pub block_size: usize,
    pub scheduler: SchedulerConfig,
    /// Longest sequence (prompt + output) accepted; defaults to the model's context.
    pub max_model_len: Option<usize>,
}

impl Default for EngineSettings {
    fn default() -> Self {
        EngineSettings {
            kv_dtype: KvDtype::F32,
            kv_budget: KvBudget::FractionOfAvailable(0.2),
            block_size: 16,
            scheduler: SchedulerConfig::default(),
            max_model_len: None,
        }
    }
}

impl EngineSettings {
    /// The checks every engine makes before it is built, and the CLI before
    /// a model is loaded: one function, so both say the same. Sizes that
    /// depend on the model or device (blocks that fit) are checked when the
    /// pool is sized.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, message: String| {
            Err(EngineError::InvalidSetting { field, message })
        };
        if self.block_size == 0 {
            return bad("block_size", "must be at least 1".into());
        }
        if self.scheduler.max_num_seqs == 0 {
            return bad("max_num_seqs", "must be at least 1".into());
        }
        if self.scheduler.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens", "must be at least 1".into());
        }
        match self.kv_budget {
            KvBudget::FractionOfAvailable(f) if !(f > 0.0 && f <= 1.0) => {
                bad("kv_cache_fraction", format!("must be in (0, 1], got {f}"))
            }
            KvBudget::Bytes(0) => bad("kv_cache_bytes", "must be at least 1".into()),
            _ => Ok(()),
        }
    }
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    #[default]
    Cpu,
    Cuda {
        ordinal: usize,
    },
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Cpu => f.write_str("cpu"),
            Placement::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl std::str::FromStr for Placement {
    type Err = String;
    /// `cpu`, `cuda` or `cuda:N`, read by the one device parser
    /// ([`envelope_cuda::DeviceSetting`]); `auto` is resolved before a
    /// placement is made ([`crate::device::resolve`]).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        use envelope_cuda::DeviceSetting;
        match s.parse::<DeviceSetting>()? {
            DeviceSetting::Cpu => Ok(Placement::Cpu),
            DeviceSetting::Cuda { ordinal } => Ok(Placement::Cuda { ordinal }),
            DeviceSetting::Auto => Err(format!(
                "`{s}` is not a placement: auto is resolved to cpu or cuda:N first"
            )),
        }
    }
}
