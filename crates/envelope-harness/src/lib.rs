//! `envelope sweep`: for every precision x KV dtype x batch policy and every
//! context bucket, search the largest concurrency that meets the SLOs, and
//! write the safe operating points as a profile with its raw data.
//!
//! Today the embedded engine is the target (in process); the `http` and
//! `launch` targets are parsed and validated but not driven yet.

pub mod config;
pub mod load;
pub mod quality;
pub mod report;
pub mod stats;
pub mod sweep;

pub use config::{BenchConfig, ConfigError};
pub use sweep::{run_sweep, SweepOutput};
