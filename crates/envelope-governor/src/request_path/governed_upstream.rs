//! One governed upstream: its governor (profile, ledger, queue, guards),
//! the client to it, its token counter and budget store, and the stages of
//! a request's path on it as methods. Both front ends are its clients: the
//! governor over one upstream ([`crate::proxy`]) and the model tiers'
//! router (the `envelope-router` crate), which places a call on one of
//! several. [`crate::upstream::start`] builds one from its spec (the
//! checks at start, the counter, the background tasks), the same way for
//! both.
//!
//! A request on it: [`GovernedUpstream::count`], then
//! [`GovernedUpstream::place`] (or [`GovernedUpstream::try_place`], which
//! never waits), then [`GovernedUpstream::send`], whose [`Sent`] answer is
//! either streamed back to the client ([`Sent::stream_back`]) or read
//! whole in the governor ([`Sent::collect`]); every ending settles through
//! the one [`Settlement`](crate::request_path::Settlement) path.

use super::timer::ReusingTimer;
use super::{self as path, headers, Collected, Counted, Incoming, OnEnd, Placed, Settlement, Wait};
use crate::admission::Governor;
use crate::client::{Answer, UpstreamClient};
use crate::error::GovernError;
use crate::identity::Identity;
use crate::request::{Endpoint, ParsedRequest};
use crate::settings::Settings;
use crate::tokens::{CountSource, TokenCounter};
use axum::http::{HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reloads the profile (the CLI supplies it); returns the new profile id.
pub type ReloadHook = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

pub struct GovernedUpstream {
    pub gov: Arc<Governor>,
    pub client: UpstreamClient,
    /// Upstream base URL, no trailing slash.
    pub upstream: String,
    pub counter: TokenCounter,
    pub reload: Option<ReloadHook>,
    /// Where budgets over time keep their buckets (in process by default).
    pub budget_store: Arc<crate::budget::Store>,
    /// `--record`: where finished requests are written (one upstream; the
    /// model tiers' router records each call instead).
    pub recorder: Option<Arc<crate::recorder::Recorder>>,
    /// `--engine-metrics`: the upstream's page, served after the governor's.
    pub engine_metrics: Option<Arc<crate::engine_metrics::EngineMetrics>>,
    /// Requests being counted at once.
    pub(crate) counting: Arc<tokio::sync::Semaphore>,
    /// The governed endpoints' URIs (by [`Endpoint`] index) and the
    /// upstream's Host header, made once (not formatted and parsed every
    /// request: docs/measurements/2026-12-06-governor-code-figures.md), or
    /// why the base does not parse, which every send then reports.
    pub(crate) endpoint_uris: Result<([Uri; 2], HeaderValue), String>,
    /// Timers for the wait on an upstream's head, reused.
    pub(crate) head_timers: ReusingTimer,
}

impl GovernedUpstream {
    pub fn new(gov: Arc<Governor>, upstream: &str, counter: TokenCounter) -> GovernedUpstream {
        let s = gov.settings();
        headers::warm();
        let upstream = upstream.trim_end_matches('/').to_string();
        let uri = |e: Endpoint| {
            let url = format!("{upstream}{}", e.path());
            url.parse::<Uri>().map_err(|err| format!("{url}: {err}"))
        };
        GovernedUpstream {
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

impl GovernedUpstream {
    /// The settings in force now: one snapshot for a request's stages.
    pub fn settings(&self) -> Arc<Settings> {
        self.gov.settings()
    }

    /// How full it is now (0..1): the most used share of its envelope.
    pub fn fullness(&self) -> f64 {
        self.gov.fullness()
    }

    /// `parsed`'s prompt tokens per group, as this upstream counts them.
    ///
    /// # Errors
    /// The count failed (an upstream tokenize call that errs, a prompt
    /// its tokenizer cannot read).
    pub async fn count(
        &self,
        settings: &Settings,
        parsed: &ParsedRequest,
    ) -> Result<Counted, GovernError> {
        path::count(self, settings, parsed).await
    }

    /// Whether `counted`, made by `by` (with `by_settings`), holds for this
    /// upstream too: made from token ids, or by the same tokenizer,
    /// tokenize endpoint or estimate, with the same cost for media parts.
    pub fn counts_like(
        &self,
        settings: &Settings,
        counted: &Counted,
        (by, by_settings): (&GovernedUpstream, &Settings),
    ) -> bool {
        let (a, b) = (&settings.counting, &by_settings.counting);
        let same_media = a.image_part_tokens == b.image_part_tokens
            && a.audio_part_tokens == b.audio_part_tokens;
        same_media
            && (counted.source == CountSource::TokenIds || self.counter.counts_as(&by.counter))
    }

    /// Plans, reserves and admits `inc` (counted as `counted`) for `who`,
    /// waiting in the admission queue until `deadline` at the latest.
    ///
    /// # Errors
    /// What the governor refuses: a request that can never fit the profile
    /// (4xx), one that fits the profile but not today's caps, its budgets or
    /// the queue in time (429), draining (503).
    pub async fn place(
        &self,
        settings: &Settings,
        inc: &Incoming,
        counted: &Counted,
        who: &Identity,
        deadline: Instant,
    ) -> Result<Placed, GovernError> {
        let placed = path::place(
            self,
            settings,
            inc,
            counted,
            who,
            Wait::UntilDeadline,
            deadline,
        );
        Ok(placed
            .await?
            .expect("a request allowed to wait is placed or refused"))
    }

    /// As [`GovernedUpstream::place`], but now or not at all: `Ok(None)`
    /// when it does not fit right now for a reason that passes (the caps,
    /// the guards, the queue, other requests), so the caller can try
    /// another upstream before anything is refused.
    ///
    /// # Errors
    /// Draining (503), or a request that can never fit this upstream (4xx).
    pub async fn try_place(
        &self,
        settings: &Settings,
        inc: &Incoming,
        counted: &Counted,
        who: &Identity,
        deadline: Instant,
    ) -> Result<Option<Placed>, GovernError> {
        path::place(self, settings, inc, counted, who, Wait::No, deadline).await
    }

    /// Sends a placed request (`parsed` is the body to forward, before the
    /// output limit is applied) and waits for its answer's head, within
    /// the upstream timeout and the request's lifetime.
    ///
    /// # Errors
    /// The upstream is unreachable or silent (502/504), or the governor is
    /// draining (503); the placement is settled as such.
    pub async fn send(
        self: &Arc<Self>,
        settings: &Settings,
        inc: &Incoming,
        parsed: &ParsedRequest,
        placed: Placed,
    ) -> Result<Sent, GovernError> {
        let sent_at = Instant::now();
        match path::send(self, settings, inc, parsed, &placed).await {
            Ok(answer) => Ok(Sent {
                up: self.clone(),
                answer,
                placed,
                sent_at,
                end: inc.end,
            }),
            Err(e) => {
                placed.held().settle(&Settlement::of_failed_send(&e));
                Err(e)
            }
        }
    }
}

/// An answer's head from a governed upstream, its placement still held:
/// streamed back to the client or read whole, and settled either way.
pub struct Sent {
    up: Arc<GovernedUpstream>,
    answer: Answer,
    placed: Placed,
    sent_at: Instant,
    end: Instant,
}

impl Sent {
    pub fn status(&self) -> StatusCode {
        self.answer.status()
    }

    /// What the request was placed as (its plan, count source, permit).
    pub fn placed(&self) -> &Placed {
        &self.placed
    }

    /// The answer relayed to the client as it comes, with the headers that
    /// say what the governor did, then `extra`; settled when its body ends
    /// (and `on_end` told how).
    pub fn stream_back(
        self,
        extra: impl IntoIterator<Item = (HeaderName, HeaderValue)>,
        on_end: Option<OnEnd>,
    ) -> Response {
        let Sent {
            up,
            answer,
            placed,
            sent_at,
            end,
        } = self;
        let headers = path::placed_headers(&placed).chain(extra);
        path::stream_back_with(
            &up,
            answer,
            Some(placed.held()),
            Some(sent_at),
            end,
            headers,
            on_end,
        )
    }

    /// The answer read whole in the governor (for a caller that looks at
    /// it before the client does) and settled as a relayed one is.
    ///
    /// # Errors
    /// It did not end whole: the upstream failed or went silent mid-answer
    /// (502), the lifetime ran out (504), or the governor is draining (503).
    pub async fn collect(self) -> Result<Collected, GovernError> {
        let Sent {
            up,
            answer,
            placed,
            sent_at,
            end,
        } = self;
        path::collect(&up, answer, placed.held(), sent_at, end).await
    }

    /// Settles a head the caller will not relay (an upstream's 5xx retried
    /// elsewhere): no tokens used.
    pub fn settle_unrelayed(self) {
        self.placed.held().settle(&Settlement {
            refused_by_upstream: true,
            ..Settlement::ended(path::Ending::Whole)
        });
    }
}
