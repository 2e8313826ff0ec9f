//! `envelope sweep`: for every precision x KV dtype x batch policy and every
//! context bucket, search the largest concurrency (or Poisson arrival rate)
//! that meets the SLOs, and write the safe operating points as a profile with
//! its raw data, plots and reports. Targets: the embedded engine in process,
//! a running OpenAI-compatible server (`http`), or a server the harness
//! starts per configuration (`launch`).

pub mod agents;
pub mod check;
pub mod config;
pub mod driver;
pub mod identity;
pub mod launch;
pub mod load;
pub mod plots;
pub mod quality;
pub mod record;
pub mod replay;
pub mod report;
pub mod sweep;
pub mod trace_load;
pub mod truth;

pub use config::{BenchConfig, ConfigError};
pub use sweep::{expected_probes, run_sweep, SweepEvent, SweepOutput};
