//! The HTTP side of one upstream: [`app`] builds the axum router (so tests
//! run it in process), [`serve`] runs it with connection limits. The two
//! governed endpoints go through the front door ([`crate::front_door`])
//! to [`handle`], which takes a request down its path
//! ([`crate::request_path`]: read, counted, planned, reserved, admitted,
//! relayed, settled). GET paths on an allowlist pass through; the
//! governor answers `/metrics` and `/admin/*` itself. Client-facing errors
//! never name the upstream's address (the log does).

mod admin;
mod passthrough;
mod serve;

use crate::error::GovernError;
use crate::front_door::{governed_routes, FrontDoor};
use crate::identity::Identity;
use crate::recorder::Draft;
use crate::refusal::RefusalCounter;
use crate::request::{Endpoint, ParsedRequest, Prompts};
use crate::request_path::{read_request, OnEnd, Placed, StreamEnd};
pub use crate::request_path::{
    relay, upstream_client, GovernedUpstream, ReloadHook, DEADLINE_HEADER,
};
use crate::tokens::{CountSource, TokenCounter};
pub use admin::{admin_allowed, from_a_browser, ADMIN_DENIED};
use admin::{admin_reload, admin_state};
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use passthrough::{metrics, passthrough};
pub use serve::serve_router;
pub use serve::{bind_and_announce, serve};
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

pub fn app(state: Arc<GovernedUpstream>) -> Router {
    governed_routes::<GovernedUpstream>()
        .route("/metrics", get(metrics))
        .route("/admin/state", get(admin_state))
        .route("/admin/reload", post(admin_reload))
        .fallback(passthrough)
        .with_state(state)
}

/// A refusal of the governor over one upstream (see [`crate::refusal`]).
pub(crate) fn reject(s: &GovernedUpstream, e: GovernError) -> Response {
    crate::refusal::refuse(&s.gov.metrics, e)
}

impl FrontDoor for GovernedUpstream {
    fn precheck(&self) -> Result<(), GovernError> {
        self.gov.precheck()
    }

    fn identify(&self, headers: &HeaderMap) -> Result<Identity, GovernError> {
        crate::identity::identify(&self.gov.settings().tenants, headers)
    }

    fn refusals(&self) -> &dyn RefusalCounter {
        &self.gov.metrics
    }

    fn serve<'a>(
        self: &'a Arc<Self>,
        endpoint: Endpoint,
        req: Request,
        arrived: Instant,
        who: &'a Identity,
    ) -> impl Future<Output = Result<Response, GovernError>> + Send + 'a {
        handle(self, endpoint, req, arrived, who)
    }
}

/// One request down the path on one upstream.
async fn handle(
    s: &Arc<GovernedUpstream>,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
    who: &Identity,
) -> Result<Response, GovernError> {
    let settings = s.settings();
    let inc = read_request(&settings, endpoint, req, arrived, who.class).await?;
    let counted = s.count(&settings, &inc.parsed).await?;
    // With --record, what the request is, for its line when it ends.
    let draft = s.recorder.as_ref().map(|_| {
        let tokens = counted.counts.first().copied().unwrap_or(0);
        crate::request_path::record::draft(&inc, tokens, who)
    });
    let refused = |draft: Option<Draft>, e: &GovernError| {
        if let (Some(r), Some(d)) = (&s.recorder, draft) {
            r.record(d.refused(e.status().as_u16(), inc.parsed.max_tokens));
        }
    };
    let placed = match s.place(&settings, &inc, &counted, who, inc.deadline).await {
        Ok(p) => p,
        Err(e) => {
            refused(draft, &e);
            return Err(e);
        }
    };
    let learn = learn_from_usage(s, &placed, &inc.parsed);
    let sent = match s.send(&settings, &inc, &inc.parsed, placed).await {
        Ok(r) => r,
        Err(e) => {
            refused(draft, &e);
            return Err(e);
        }
    };
    let on_end = both(learn, record_at_end(s, draft, sent.status().as_u16()));
    Ok(sent.stream_back([], on_end))
}

/// One callback at a body's end from two.
fn both(a: Option<OnEnd>, b: Option<OnEnd>) -> Option<OnEnd> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Box::new(move |end: StreamEnd| {
            a(end);
            b(end);
        })),
        (a, b) => a.or(b),
    }
}

/// With `--record`: the request's line, written when its body ends.
fn record_at_end(s: &GovernedUpstream, draft: Option<Draft>, status: u16) -> Option<OnEnd> {
    let (recorder, draft) = (s.recorder.clone()?, draft?);
    Some(Box::new(move |end: StreamEnd| {
        recorder.record(crate::request_path::record::ended(draft, status, &end));
    }))
}

/// For a text prompt counted by the learnt estimate: feeds the answer's
/// `usage.prompt_tokens` back into it when the answer ends whole.
fn learn_from_usage(
    s: &GovernedUpstream,
    placed: &Placed,
    parsed: &ParsedRequest,
) -> Option<OnEnd> {
    let TokenCounter::Learnt(e) = &s.counter else {
        return None;
    };
    let one_text = matches!(&parsed.prompts, Prompts::Texts(v) if v.len() == 1)
        || matches!(parsed.prompts, Prompts::Messages(_));
    if placed.source != CountSource::Estimate || !one_text {
        return None;
    }
    let (e, bytes) = (e.clone(), crate::tokens::prompt_bytes(&parsed.prompts));
    Some(Box::new(move |end: StreamEnd| {
        if let (true, Some(tokens)) = (end.whole, end.prompt_tokens) {
            e.observe(bytes, tokens);
        }
    }))
}
