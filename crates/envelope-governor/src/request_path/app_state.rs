//! What the request path of one upstream runs on: its governor, the client
//! to it, its token counter and budget store, and what is made once for
//! every request (its endpoints' URIs, the timers of the wait on a head).

use super::headers;
use super::timer::ReusingTimer;
use crate::admission::Governor;
use crate::client::UpstreamClient;
use crate::request::Endpoint;
use crate::settings::Settings;
use crate::tokens::TokenCounter;
use axum::http::{HeaderValue, Uri};
use std::sync::Arc;
use std::time::Duration;

/// Reloads the profile (the CLI supplies it); returns the new profile id.
pub type ReloadHook = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

pub struct AppState {
    pub gov: Arc<Governor>,
    pub client: UpstreamClient,
    /// Upstream base URL, no trailing slash.
    pub upstream: String,
    pub counter: TokenCounter,
    pub reload: Option<ReloadHook>,
    /// Where budgets over time keep their buckets (in process by default).
    pub budget_store: Arc<crate::budget::Store>,
    /// `--record`: where finished requests are written (single upstream;
    /// with model tiers the router records each call instead).
    pub recorder: Option<Arc<crate::recorder::Recorder>>,
    /// `--engine-metrics`: the upstream's page, served after the governor's.
    pub engine_metrics: Option<Arc<crate::engine_metrics::EngineMetrics>>,
    /// Requests being counted at once.
    pub(super) counting: Arc<tokio::sync::Semaphore>,
    /// The governed endpoints' URIs (by [`Endpoint`] index) and the
    /// upstream's Host header, made once (not formatted and parsed every
    /// request: docs/measurements/2026-12-06-governor-code-figures.md), or
    /// why the base does not parse, which every send then reports.
    pub(super) endpoint_uris: Result<([Uri; 2], HeaderValue), String>,
    /// Timers for the wait on an upstream's head, reused.
    pub(super) head_timers: ReusingTimer,
}

impl AppState {
    pub fn new(gov: Arc<Governor>, upstream: &str, counter: TokenCounter) -> AppState {
        let s = gov.settings();
        headers::warm();
        let upstream = upstream.trim_end_matches('/').to_string();
        let uri = |e: Endpoint| {
            let url = format!("{upstream}{}", e.path());
            url.parse::<Uri>().map_err(|err| format!("{url}: {err}"))
        };
        AppState {
            client: UpstreamClient::counted(
                Duration::from_millis(s.timeouts.connect_timeout_ms),
                gov.metrics.connection_counters(),
            ),
            counting: Arc::new(tokio::sync::Semaphore::new(s.counting.max_counting)),
            gov,
            endpoint_uris: uri(Endpoint::Completions).and_then(|a| {
                let host = crate::client::host_of(&a)
                    .ok_or_else(|| format!("{upstream}: no host to connect to"))?;
                Ok(([a, uri(Endpoint::Chat)?], host))
            }),
            upstream,
            counter,
            reload: None,
            budget_store: Arc::new(crate::budget::Store::local()),
            recorder: None,
            engine_metrics: None,
            head_timers: ReusingTimer::default(),
        }
    }
}

/// The client to the upstream: a connect timeout, no redirects followed.
pub fn upstream_client(s: &Settings) -> UpstreamClient {
    UpstreamClient::new(Duration::from_millis(s.timeouts.connect_timeout_ms))
}
