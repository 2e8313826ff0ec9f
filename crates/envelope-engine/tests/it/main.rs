//! The engine's integration tests, one binary: each file below is a module.

mod common;

mod reference_logits;
mod smollm2;
mod sources;
