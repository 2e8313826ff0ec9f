//! envelope's governor: a sidecar in front of an OpenAI-compatible server
//! that enforces a measured profile's limits (context, output, concurrent
//! sequences, KV tokens in flight) with a bounded, fair admission queue and
//! a live guard. It depends on `envelope-profile` and `envelope-telemetry`
//! only: no engine, no CUDA.
//!
//! Bookkeeping is plain data with unit tests ([`ledger`], [`queue`],
//! [`ladder`], [`policy`], [`request`]); [`admission`] and
//! [`request_path`] (a request's stages) wrap it in a thin async layer;
//! [`GovernedUpstream`] is one upstream with those
//! stages as methods, for both front ends: [`proxy`] (one upstream) and
//! the model tiers' router (the `envelope-router` crate). [`client`] is its HTTP client
//! to the upstream; [`error`] is the one mapping
//! from failures to HTTP status, OpenAI body and reason label. [`config`]
//! holds every setting (flags, environment, TOML file, defaults) and
//! [`start`] runs the process: checks, background tasks, reload, drain.

pub mod admission;
pub mod answer_usage;
pub mod budget;
pub mod client;
pub mod config;
pub mod drain;
pub mod engine_metrics;
pub mod error;
pub mod front_door;
pub mod identity;
pub mod ladder;
pub mod latency;
pub mod learnt_estimate;
pub mod ledger;
pub mod live_guard;
pub mod metrics;
pub mod names;
pub mod pod_load;
pub mod policy;
pub mod prefix_cache;
pub mod price;
pub mod proxy;
pub mod queue;
pub mod recorder;
pub mod refusal;
pub mod request;
pub mod request_path;
pub mod settings;
pub mod signals;
pub mod start;
pub mod tokens;
pub mod upstream;
pub mod upstream_tokenize;

pub use admission::{Ask, Governor, Permit};
pub use client::{Answer, UpstreamClient};
pub use config::{GovernArgs, OnMismatch, TokenCount};
pub use error::{GovernError, OverloadReason, StartError};
pub use ladder::{LadderSettings, Level, Reading};
pub use latency::LatencySettings;
pub use ledger::{Demand, Share};
pub use proxy::{app, relay, serve, upstream_client, GovernedUpstream, ReloadHook};
pub use queue::Class;
pub use request_path::Sent;
pub use settings::{
    Beyond, OverBudget, OverLimit, Settings, SettingsDraft, TenantsConfig, TenantsSettings,
};
pub use tokens::{CountSource, TokenCounter};
