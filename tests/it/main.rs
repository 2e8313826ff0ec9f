//! envelope's integration tests, one binary: each file below is a module
//! (a binary per file linked the whole crate graph ~13 times over).

mod common;

mod device;
mod emulated_gpu;
mod foreign_servers;
mod gate;
mod govern;
mod govern_budgets;
mod govern_envelope;
mod govern_picker;
mod govern_record;
mod govern_refusals;
mod govern_tiers;
mod plan;
mod report;
mod serve;
mod sweep_scaled;
mod sweep_targets;
mod telemetry;
