//! The profile: measured safe operating points, versioned, as the harness
//! writes them and the governor enforces them. Also the plain arithmetic
//! around them (KV capacity, headroom) and the concurrency search bracket.
//! No GPU, no async, no engine: everything here is data and unit-tested.

pub mod capacity;
pub mod confidence;
pub mod gate;
pub mod plan;
pub mod quality;
pub mod schema;
pub mod search;
pub mod stats;
pub mod trace;
pub mod workload;

pub use quality::QualityReport;
pub use schema::*;
pub use search::{LevelSearch, LevelStep, LevelVerdict};
