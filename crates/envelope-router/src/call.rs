//! One call through the tiers: identify, read, route, look up the cache,
//! place (the starting tier now, else a fallback tier now, else wait on
//! the starting tier; a call that can never fit its tier goes up), send,
//! check the whole answer and retry once a tier up when it fails, book
//! every attempt, and answer with headers that say what happened.

use super::book::{Outcome, Story, Tag};
use super::cache::{cacheable, Cached, Key, CACHEABLE_HEADER};
use super::check::{check, read_answer, AssembledAnswer, Expect, Usage};
use super::config::{Check, StreamMode};
use super::cost::NO_FEATURE;
use super::failure::{next_move, which_stands, Failure, Lower, Move, Stands, Tried, Upper};
use super::metrics::labels;
use super::read_call::{upstream_failed, Call};
use super::route::{body_signals, route};
use super::state::{Live, TierRouter, Upstream};
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use envelope_governor::error::GovernError;
use envelope_governor::front_door::FrontDoor;
use envelope_governor::identity::Identity;
use envelope_governor::refusal::RefusalCounter;
use envelope_governor::request::Endpoint;
use envelope_governor::request_path::{self as path, Counted, Incoming, Placed};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use envelope_governor::identity::named;
pub const HINT_HEADER: &str = "x-envelope-tier-hint";
pub const NO_TRUNCATION_HEADER: &str = "x-envelope-no-truncation";

fn truthy(h: &HeaderMap, header: &str) -> bool {
    h.get(header)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes"))
}

/// Whether a placement may wait in an upstream's admission queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wait {
    /// Placed now or not at all, so another upstream can be tried.
    No,
    /// Queued until the call's deadline on that tier.
    UntilDeadline,
}

/// One attempt on one upstream, whole.
struct Whole {
    tier: usize,
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    answer: Option<AssembledAnswer>,
    placed_headers: path::Extra,
    cost: f64,
}

impl TierRouter {
    fn deadline_on(&self, live: &Live, tier: usize, inc: &Incoming) -> Instant {
        match live.tiers[tier].latency_budget_ms {
            Some(ms) => inc.deadline.min(inc.arrived + Duration::from_millis(ms)),
            None => inc.deadline,
        }
    }

    /// Tries tier `tier`'s upstreams, the one with most room first.
    async fn place_on(
        &self,
        live: &Live,
        tier: usize,
        call: &Call,
        wait: Wait,
    ) -> Result<Option<(Arc<Upstream>, Placed)>, GovernError> {
        let deadline = self.deadline_on(live, tier, &call.inc);
        let mut last: Option<GovernError> = None;
        for up in live.by_room(tier) {
            let settings = up.app.settings();
            let placed = async {
                let parsed = &call.inc.parsed;
                let (inc, who) = (&call.inc, &call.who);
                let recounted;
                let counted = match &call.counted_by {
                    Some((by, st)) if up.app.counts_like(&settings, &call.counted, (by, st)) => {
                        &call.counted
                    }
                    _ => {
                        recounted = up.app.count(&settings, parsed).await?;
                        &recounted
                    }
                };
                match wait {
                    Wait::No => {
                        up.app
                            .try_place(&settings, inc, counted, who, deadline)
                            .await
                    }
                    Wait::UntilDeadline => {
                        let p = up.app.place(&settings, inc, counted, who, deadline).await?;
                        Ok(Some(p))
                    }
                }
            };
            match placed.await {
                Ok(Some(p)) => return Ok(Some((up, p))),
                Ok(None) => {}
                Err(e) => match next_move(Tried::Upstream, Failure::of(&e)) {
                    Move::Refuse => return Err(e),
                    Move::Next | Move::Above => last = Some(e),
                },
            }
            if wait == Wait::UntilDeadline && last.is_none() {
                break;
            }
        }
        match last {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    /// Where the call runs: its tier if it has room now, else the first
    /// fallback tier with room now (never when pinned), else a wait on its
    /// own tier. A call that can never fit its tier tries the tiers above.
    async fn placement(
        &self,
        live: &Live,
        call: &Call,
        start: usize,
    ) -> Result<(usize, Arc<Upstream>, Placed), GovernError> {
        let mut now = vec![start];
        if !call.route.pinned {
            now.extend(live.fallbacks(start));
        }
        let mut too_big: Option<GovernError> = None;
        for &t in &now {
            let tried = Tried::TierNow {
                start: t == start,
                alone: now.len() == 1,
            };
            match self.place_on(live, t, call, Wait::No).await {
                Ok(Some((up, p))) => return Ok((t, up, p)),
                Ok(None) => {}
                Err(e) => match next_move(tried, Failure::of(&e)) {
                    Move::Next => {}
                    Move::Above => too_big = Some(e),
                    Move::Refuse => return Err(e),
                },
            }
        }
        let mut waits: Vec<usize> = vec![start];
        if too_big.is_some() && !call.route.pinned {
            waits = (start + 1..live.tiers.len()).collect();
        }
        let mut last = too_big;
        for t in waits {
            match self.place_on(live, t, call, Wait::UntilDeadline).await {
                Ok(Some((up, p))) => return Ok((t, up, p)),
                Ok(None) => {}
                Err(e) => match next_move(Tried::TierWaiting, Failure::of(&e)) {
                    Move::Refuse => return Err(e),
                    Move::Next | Move::Above => last = Some(e),
                },
            }
        }
        Err(last.unwrap_or_else(|| {
            GovernError::invalid(None, "no tier can take this call".to_string())
        }))
    }

    /// Sends a placed call and reads the whole answer (within its lifetime).
    async fn attempt(
        &self,
        live: &Live,
        call: &Call,
        tier: usize,
        up: &Upstream,
        placed: Placed,
    ) -> Result<Whole, GovernError> {
        let settings = up.app.settings();
        let parsed = up.body_for(&call.inc.parsed);
        let prompt = placed.plan.prompt_tokens;
        let placed_headers = path::placed_headers(&placed).collect();
        let sent = up.app.send(&settings, &call.inc, &parsed, placed).await;
        // Read whole and settled as a client's answer is (usage, latency
        // samples, faults), before the checks look at it.
        let got = match sent {
            Ok(sent) => sent.collect().await,
            Err(e) => Err(e),
        };
        let got = match got {
            Ok(c) => c,
            Err(e) => {
                // Nothing (whole) came back: the prompt was sent, so book it.
                let u = Usage {
                    prompt,
                    ..Usage::default()
                };
                self.book_attempt(live, tier, &call.tag, &up.price, u);
                return Err(e);
            }
        };
        // Its usage (or its events less the `[DONE]`) is what it used.
        let answer = read_answer(&got.body, got.sse);
        let usage = answer.as_ref().and_then(|a| a.usage).unwrap_or(Usage {
            prompt,
            completion: answer.as_ref().map_or(0, |a| a.events.saturating_sub(1)),
            cached: 0,
        });
        let cost = self.book_attempt(live, tier, &call.tag, &up.price, usage);
        Ok(Whole {
            tier,
            status: got.status,
            headers: got.headers,
            body: got.body,
            answer,
            placed_headers,
            cost,
        })
    }

    /// The check an attempt failed, if escalation looks at it.
    fn failed(&self, live: &Live, call: &Call, r: &Result<Whole, GovernError>) -> Option<Check> {
        let on = &live.file.escalation.on;
        match r {
            Ok(w) => check(on, &call.expect, w.status.as_u16(), w.answer.as_ref()),
            Err(e) if upstream_failed(e) => on
                .contains(&Check::UpstreamError)
                .then_some(Check::UpstreamError),
            Err(_) => None,
        }
    }
}

fn respond(live: &Live, w: Whole, s: &Story) -> Response {
    let mut r = Response::new(Body::from(w.body));
    *r.status_mut() = w.status;
    *r.headers_mut() = w.headers;
    let mut extra: Vec<(&'static str, String)> = vec![
        ("x-envelope-tier", live.tiers[w.tier].name.clone()),
        ("x-envelope-route-reason", s.reason.clone()),
        ("x-envelope-tiers-version", live.file.version.clone()),
        ("x-envelope-cache", s.cache.to_string()),
        ("x-envelope-cost", format!("{:.9}", s.cost)),
    ];
    if let Some(f) = s.fell_back_from {
        extra.push(("x-envelope-fallback-from", live.tiers[f].name.clone()));
    }
    if let Some((c, from)) = s.escalated {
        extra.push(("x-envelope-escalated", c.label().to_string()));
        extra.push(("x-envelope-escalated-from", live.tiers[from].name.clone()));
    }
    if let Some(why) = &s.escalation_failed {
        extra.push(("x-envelope-escalation", format!("failed: {why}")));
    }
    let h = r.headers_mut();
    for (k, v) in w.placed_headers.into_iter().chain(path::named(extra)) {
        h.insert(k, v);
    }
    r
}

/// A refusal of the governor over model tiers (see [`envelope_governor::refusal`]).
pub(super) fn refuse(r: &TierRouter, e: GovernError) -> Response {
    envelope_governor::refusal::refuse(&r.metrics, e)
}

impl FrontDoor for TierRouter {
    fn precheck(&self) -> Result<(), GovernError> {
        match self.is_draining() {
            true => Err(GovernError::Draining),
            false => Ok(()),
        }
    }

    fn identify(&self, headers: &HeaderMap) -> Result<Identity, GovernError> {
        envelope_governor::identity::identify(&self.live().front().tenants, headers)
    }

    fn refusals(&self) -> &dyn RefusalCounter {
        &self.metrics
    }

    async fn serve(
        self: &Arc<Self>,
        endpoint: Endpoint,
        req: Request,
        arrived: Instant,
        who: &Identity,
    ) -> Result<Response, GovernError> {
        let live = self.live();
        serve_call(self, &live, endpoint, req, arrived, who).await
    }
}

/// One call, as named steps: read and route it, answer it from the cache,
/// place it, answer it whole (escalating once when a check fails) or
/// stream it, and book what happened.
async fn serve_call(
    r: &Arc<TierRouter>,
    live: &Arc<Live>,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
    who: &Identity,
) -> Result<Response, GovernError> {
    let (call, marked) = read_and_route(r, live, endpoint, req, arrived, who).await?;
    let start = call.route.tier;
    // The cache first: a hit takes no room on any upstream.
    let cache = r
        .cache()
        .filter(|_| call.buffered && cacheable(call.inc.parsed.body(), marked))
        .map(|c| (c, cache_key(live, &call)));
    if let Some((c, key)) = &cache {
        let hit = c.get(key);
        let result = if hit.is_some() { "hit" } else { "miss" };
        r.metrics
            .cache
            .get_or_create(&labels(&[("result", result)]))
            .inc();
        if let Some(hit) = hit {
            return Ok(cached_answer(r, live, &call, hit));
        }
    }
    let mut story = Story {
        start,
        reason: call.route.reason.clone(),
        fell_back_from: None,
        escalated: None,
        escalation_failed: None,
        cache: if cache.is_some() { "miss" } else { "off" },
        cost: 0.0,
    };
    let (tier, up, placed) = match r.placement(live, &call, start).await {
        Ok(x) => x,
        Err(e) => return Err(book_unanswered(r, live, &call, Outcome::Refused, &story, e)),
    };
    story.fell_back_from = (tier != start).then_some(start);
    if let Some(f) = story.fell_back_from {
        r.book_fallback(live, f, tier);
    }
    if !call.buffered {
        return super::stream::stream_through(r, live, &call, tier, up, placed, &mut story).await;
    }
    let (answered, failed) = r
        .answer_whole(live, &call, tier, &up, placed, &mut story)
        .await;
    let w = match answered {
        Ok(w) => w,
        Err(e) => return Err(book_unanswered(r, live, &call, Outcome::Error, &story, e)),
    };
    book_answer(r, live, &call, &w, &story);
    // Only an answer that passes the call's checks is kept for repeats.
    if let Some((c, key)) = cache {
        let passes = check(
            &live.file.escalation.on,
            &call.expect,
            w.status.as_u16(),
            w.answer.as_ref(),
        )
        .is_none();
        if w.status.is_success() && passes && story.escalation_failed.is_none() {
            // Under the starting tier, with the tier that answered: a
            // repeat is answered as the first one finally was.
            c.put(key, cached(live, &w));
        }
    }
    if w.status.is_success()
        && failed.is_none()
        && w.tier + 1 < live.tiers.len()
        && !call.route.pinned
    {
        if let Some(a) = &w.answer {
            let (inc, who, tag) = (&call.inc, &call.who, &call.tag);
            super::shadow::maybe(
                r,
                live,
                inc,
                who,
                tag,
                &story.reason,
                &call.expect,
                w.tier,
                a,
            );
        }
    }
    Ok(respond(live, w, &story))
}

/// Reads the call (its headers once, its prompt counted once), routes it
/// and counts the route; with whether the caller marked it cacheable.
async fn read_and_route(
    r: &TierRouter,
    live: &Live,
    endpoint: Endpoint,
    req: Request,
    arrived: Instant,
    who: &Identity,
) -> Result<(Call, bool), GovernError> {
    let base = live.tiers[0].upstreams[0].app.clone();
    let settings = base.settings();
    let inc = path::read_request(&live.front(), endpoint, req, arrived, who.class).await?;
    let h = &inc.parts.headers;
    let feature = inc.feature.clone();
    let hint = named(h, HINT_HEADER)?;
    // One tenant's conversation never moves another's routing.
    let conversation = inc
        .conversation
        .as_ref()
        .map(|c| format!("{}\u{0}{c}", who.tenant));
    let mut signals = body_signals(inc.parsed.body());
    // Counted once, for routing and for every tier that counts the same
    // way. When the first tier cannot count, the bound estimate routes
    // and each tier counts for itself.
    let (counted, counted_by) = match base.count(&settings, &inc.parsed).await {
        Ok(c) => (c, Some((base, settings))),
        Err(_) => {
            let bound = envelope_governor::tokens::estimate(
                &inc.parsed,
                envelope_governor::tokens::BOUND_BYTES_PER_TOKEN,
            );
            let c = Counted {
                counts: bound,
                source: envelope_governor::tokens::CountSource::EstimateAfterTimeout,
            };
            (c, None)
        }
    };
    signals.prompt_tokens = counted.counts.iter().copied().max().unwrap_or(0);
    let draft = r
        .recorder
        .get()
        .map(|_| path::record::draft(&inc, signals.prompt_tokens, who));
    signals.max_tokens = inc.parsed.max_tokens;
    signals.hint = hint;
    signals.feature = feature.clone();
    signals.escalated_before = conversation
        .as_ref()
        .is_some_and(|c| r.escalated.contains_key(c));
    let route = route(&live.file, &signals);
    r.metrics
        .routes
        .get_or_create(&labels(&[
            ("tier", &live.tiers[route.tier].name),
            ("reason", &route.reason),
        ]))
        .inc();
    let expect = Expect::of(inc.parsed.body(), truthy(h, NO_TRUNCATION_HEADER));
    let buffered = !inc.parsed.stream || live.file.escalation.streams == StreamMode::Buffer;
    let marked = truthy(h, CACHEABLE_HEADER);
    let call = Call {
        buffered,
        expect,
        route,
        conversation,
        draft,
        tag: Tag {
            // Bounded labels for the book and /metrics; routing saw the name.
            feature: r.feature_label(live, feature.as_deref().unwrap_or(NO_FEATURE)),
            tenant: who.tenant.clone(),
        },
        who: who.clone(),
        inc,
        counted,
        counted_by,
    };
    Ok((call, marked))
}

/// The cache's key for a call: its tenant, its starting tier and
/// everything else that shapes the answer (the endpoint, the model, the
/// upstreams serving it, the truncation rule), and the request.
fn cache_key(live: &Live, call: &Call) -> Key {
    let start = &live.tiers[call.route.tier];
    Key {
        tenant: call.who.tenant.clone(),
        tier: start.name.clone(),
        model: format!(
            "{}|{}|{}|{}",
            call.inc.parsed.endpoint.label(),
            start.upstreams[0].model_for(&call.inc.parsed),
            start
                .upstreams
                .iter()
                .map(|u| u.spec.url.as_str())
                .collect::<Vec<_>>()
                .join(","),
            call.expect.no_truncation
        ),
        request: call.inc.parsed.raw().clone(),
    }
}

/// A whole answer as the cache keeps it, with the tier that gave it.
fn cached(live: &Live, w: &Whole) -> Cached {
    let content_type = w
        .headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    Cached {
        content_type,
        body: w.body.clone(),
        tier: live.tiers[w.tier].name.clone(),
    }
}

/// Books a call that got no answer (refused, or failed) under its
/// starting tier; the error goes on to the caller.
fn book_unanswered(
    r: &TierRouter,
    live: &Live,
    call: &Call,
    outcome: Outcome,
    story: &Story,
    e: GovernError,
) -> GovernError {
    let (status, rec) = (e.status().as_u16(), call.rec(None));
    r.book_call(
        live,
        story.start,
        &call.tag,
        outcome,
        0.0,
        story,
        status,
        rec,
    );
    e
}

/// Books an answered call under the tier that answered it.
fn book_answer(r: &TierRouter, live: &Live, call: &Call, w: &Whole, story: &Story) {
    let ms = call.inc.arrived.elapsed().as_secs_f64() * 1000.0;
    let outcome = if story.escalated.is_some() {
        Outcome::Escalated
    } else {
        Outcome::Ok
    };
    let output = w.answer.as_ref().map_or(0, |a| {
        a.usage.map_or(a.events.saturating_sub(1), |u| u.completion)
    });
    let (status, rec) = (w.status.as_u16(), call.rec(Some((output, None))));
    r.book_call(live, w.tier, &call.tag, outcome, ms, story, status, rec);
}

impl TierRouter {
    /// The placed call's whole answer: one attempt, and when its answer
    /// fails a check escalation looks at (and the call is not pinned and
    /// has a tier above), one more on the tier up; [`which_stands`] picks
    /// the answer. With the check the first answer failed.
    async fn answer_whole(
        &self,
        live: &Live,
        call: &Call,
        tier: usize,
        up: &Upstream,
        placed: Placed,
        story: &mut Story,
    ) -> (Result<Whole, GovernError>, Option<Check>) {
        let first = self.attempt(live, call, tier, up, placed).await;
        story.cost += first.as_ref().map_or(0.0, |w| w.cost);
        let failed = self.failed(live, call, &first);
        let up_one = tier + 1;
        let Some(check) = failed.filter(|_| !call.route.pinned && up_one < live.tiers.len()) else {
            return (first, failed);
        };
        self.book_escalation(live, tier, &call.tag, check);
        if let Some(c) = &call.conversation {
            self.escalated.insert(c.clone(), ());
        }
        let second = match self.placement_up(live, call, up_one).await {
            Ok((up2, p2)) => self.attempt(live, call, up_one, &up2, p2).await,
            Err(e) => Err(e),
        };
        let upper = match &second {
            Ok(w) if w.status.is_server_error() => Upper::ServerError,
            Ok(_) => Upper::Answered,
            Err(_) => Upper::Refused,
        };
        let lower = match &first {
            Ok(w) if w.status.is_success() => Lower::Success,
            Ok(_) => Lower::OtherStatus,
            Err(_) => Lower::None,
        };
        story.cost += second.as_ref().map_or(0.0, |w| w.cost);
        let answered = match (
            which_stands(upper, lower, live.file.escalation.out_of_time),
            second,
        ) {
            (Stands::Upper, Ok(w)) => {
                story.escalated = Some((check, tier));
                Ok(w)
            }
            (Stands::Lower, second) => {
                story.escalation_failed = Some(match second {
                    Ok(w) => format!("upstream status {}", w.status.as_u16()),
                    Err(e) => e.reason().to_string(),
                });
                first
            }
            (_, second) => second,
        };
        (answered, failed)
    }
}

impl TierRouter {
    /// Placement for an escalated attempt: the tier given, waiting within
    /// the call's deadline.
    pub(super) async fn placement_up(
        &self,
        live: &Live,
        call: &Call,
        tier: usize,
    ) -> Result<(Arc<Upstream>, Placed), GovernError> {
        if Instant::now() >= call.inc.deadline {
            return Err(GovernError::Overloaded {
                reason: envelope_governor::error::OverloadReason::DeadlineUnmeetable,
                retry_after_s: 1,
                message: "no time left in the request's deadline to escalate".into(),
            });
        }
        if let Some(x) = self.place_on(live, tier, call, Wait::No).await? {
            return Ok(x);
        }
        self.place_on(live, tier, call, Wait::UntilDeadline)
            .await?
            .ok_or_else(|| GovernError::invalid(None, "no upstream on the tier up".to_string()))
    }
}

fn cached_answer(r: &TierRouter, live: &Live, call: &Call, hit: Cached) -> Response {
    let tier = live.file.index(&hit.tier).unwrap_or(call.route.tier);
    let story = Story {
        start: call.route.tier,
        reason: call.route.reason.clone(),
        fell_back_from: None,
        escalated: None,
        escalation_failed: None,
        cache: "hit",
        cost: 0.0,
    };
    let ms = call.inc.arrived.elapsed().as_secs_f64() * 1000.0;
    // The answer's own `usage` (read only when recording), by the one
    // reader of answers.
    let output = call.draft.as_ref().map_or(0, |_| {
        let sse = hit.content_type.starts_with("text/event-stream");
        read_answer(&hit.body, sse)
            .and_then(|a| a.usage)
            .map_or(0, |u| u.completion)
    });
    r.book_call(
        live,
        tier,
        &call.tag,
        Outcome::Cached,
        ms,
        &story,
        200,
        call.rec(Some((output, None))),
    );
    let mut h = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(&hit.content_type) {
        h.insert("content-type", v);
    }
    let w = Whole {
        tier,
        status: StatusCode::OK,
        headers: h,
        body: hit.body,
        answer: None,
        placed_headers: vec![],
        cost: 0.0,
    };
    respond(live, w, &story)
}
