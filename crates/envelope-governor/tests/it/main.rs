//! The governor's integration tests, one binary: each file below is a module.

mod common;

mod budget;
mod failures;
mod guard;
mod hardening;
mod proxy;
