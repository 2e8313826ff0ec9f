//! envelope's readings of the world: GPU state through NVML (loaded at run
//! time, so a machine without the driver still builds and runs) with a host
//! fallback, inference-server metrics mapped to one [`EngineState`], and the
//! [`Fingerprint`] every profile is keyed by.
//!
//! No engine, no CUDA toolkit, no async runtime in the sampling path: the
//! governor depends on this crate.

pub mod engine_state;
pub mod fingerprint;
pub mod gpu;
pub mod host;
pub mod node_text;
pub mod sampler;

pub use engine_state::{
    fetch_engine_state, parse_engine_state, EngineKind, EngineState, MetricsClient, MetricsError,
};
pub use fingerprint::{EngineIdentity, Fingerprint, ModelIdentity, NodeFingerprint};
pub use gpu::{GpuSample, Nvml, NvmlUnavailable};
pub use host::HostSample;
pub use sampler::{Sample, Sampler, SamplerConfig, Source};

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
