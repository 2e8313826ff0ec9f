//! `envelope govern --tiers` in front of real `envelope serve` upstreams as
//! model tiers (dummy presets with different seeds, and SmolLM2): routing
//! by each signal, escalation of an invalid-JSON answer and of a stream
//! whose upstream is down, fallback from a
//! saturated tier before any 429, the cache for deterministic calls only,
//! shadow agreement, costs that add up to the tokens served, and reload
//! and rollback of the tiers file.

use crate::common;

use common::tiers::*;
use serde_json::{json, Value};
use std::time::Duration;

/// One test at a time: each starts its own servers, and two SmolLM2s on
/// two cores would only slow each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

mod cache_and_shadow;
mod costs;
mod escalation;
mod fallback;
mod reload;
mod routing;
mod streams;
