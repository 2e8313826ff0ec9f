//! Model tiers (`envelope govern --tiers tiers.toml`), the governor's
//! second front end: the governor in
//! front of several upstreams grouped into tiers by role, cheapest first.
//! Each call starts on the cheapest tier its signals allow ([`route`]), is
//! placed on an upstream with room now (or on a fallback tier before any
//! refusal), is checked when whole ([`check`]) and retried once a tier up
//! when it fails, may be answered from the cache of deterministic calls
//! ([`cache`]), and is booked per feature, tenant and tier under the price
//! contract ([`cost`]). A sample of cheap-tier answers is compared, off
//! the request path, with the next tier up (shadow calibration).
//!
//! Each upstream keeps everything the single-upstream governor enforces:
//! its own profile, ledger, queue, live guard and latency guard: it is an
//! [`envelope_governor::GovernedUpstream`], on which the router counts,
//! places and sends through that type's methods, as the governor over
//! one upstream does.
//!
//! Layers: `config` <- `route`, `check`, `cost`, `cache`, `metrics`,
//! `failure` (what a refusal or failed answer leads to) <-
//! `state` (one version of the file, running) <- `shadow` <- `call` (the
//! request path) <- `start` (start-up, reload, rollback, the HTTP app).

mod book;
pub mod cache;
mod call;
pub mod check;
pub mod config;
pub mod cost;
mod failure;
pub mod metrics;
mod read_call;
pub mod route;
mod shadow;
mod start;
mod state;
mod stream;

pub use config::TiersSettings;
pub use start::run;
