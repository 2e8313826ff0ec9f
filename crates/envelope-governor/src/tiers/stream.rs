//! A streamed call passed through as it comes: no escalation once bytes
//! flow to the client; an upstream that cannot be reached (or answers a
//! 5xx head) is still retried a tier up. The call is booked, and with
//! `--record` written, when the stream ends.

use super::book::{CallRecord, Outcome, Story};
use super::check::Usage;
use super::config::Check;
use super::read_call::{upstream_failed, Call};
use super::state::{Live, TierRouter, Upstream};
use crate::error::GovernError;
use crate::request_path::{self as path, Ending, Placed, Settlement};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

/// A stream passed through as it comes (no escalation once bytes flow; an
/// upstream that cannot be reached is still retried a tier up).
pub(super) async fn stream_through(
    r: &Arc<TierRouter>,
    live: &Arc<Live>,
    call: &Call,
    tier: usize,
    up: Arc<Upstream>,
    placed: Placed,
    story: &mut Story,
) -> Result<Response, GovernError> {
    let (mut tier, mut up, mut placed) = (tier, up, placed);
    let mut escalated = false;
    let resp = loop {
        let settings = up.app.gov.settings();
        let parsed = up.body_for(&call.inc.parsed);
        let sent = path::send(&up.app, &settings, &call.inc, &parsed, &placed).await;
        // Nothing has gone to the client yet: an upstream that failed
        // (unreachable, or a 5xx head) may still be retried a tier up.
        let may = !escalated
            && !call.route.pinned
            && tier + 1 < live.tiers.len()
            && live.file.escalation.on.contains(&Check::UpstreamError);
        let (failed, settlement) = match sent {
            Ok(resp) if !(may && resp.status().is_server_error()) => break resp,
            Ok(resp) => (
                GovernError::UpstreamUnreachable(format!(
                    "the upstream answered {}",
                    resp.status().as_u16()
                )),
                Settlement {
                    refused_by_upstream: true,
                    ..Settlement::ended(Ending::Whole)
                },
            ),
            Err(e) => {
                let s = Settlement::of_failed_send(&e);
                (e, s)
            }
        };
        let u = Usage {
            prompt: placed.plan.prompt_tokens,
            ..Usage::default()
        };
        story.cost += r.book_attempt(live, tier, &call.tag, &up.price, u);
        placed.held().settle(&settlement);
        let placed_up = if may && upstream_failed(&failed) {
            r.book_escalation(live, tier, &call.tag, Check::UpstreamError);
            story.escalated = Some((Check::UpstreamError, tier));
            escalated = true;
            tier += 1;
            r.placement_up(live, call, tier).await
        } else {
            Err(failed)
        };
        match placed_up {
            Ok((u2, p2)) => {
                up = u2;
                placed = p2;
            }
            Err(e) => {
                let status = e.status().as_u16();
                r.book_call(
                    live,
                    story.start,
                    &call.tag,
                    Outcome::Error,
                    0.0,
                    story,
                    status,
                    call.rec(None),
                );
                return Err(e);
            }
        }
    };
    let status = resp.status();
    let mut placed_headers: path::Extra = path::placed_headers(&placed).collect();
    let mut extra: Vec<(&'static str, String)> = vec![
        ("x-envelope-tier", live.tiers[tier].name.clone()),
        ("x-envelope-route-reason", story.reason.clone()),
        ("x-envelope-tiers-version", live.file.version.clone()),
        ("x-envelope-cache", "off".into()),
    ];
    if let Some(f) = story.fell_back_from {
        extra.push(("x-envelope-fallback-from", live.tiers[f].name.clone()));
    }
    if let Some((c, from)) = story.escalated {
        extra.push(("x-envelope-escalated", c.label().into()));
        extra.push(("x-envelope-escalated-from", live.tiers[from].name.clone()));
    }
    let prompt = placed.plan.prompt_tokens;
    let (r2, live2, up2) = (r.clone(), live.clone(), up.clone());
    let tag = call.tag.clone();
    let mut story = story.clone();
    let arrived = call.inc.arrived;
    let (draft, max_tokens) = (call.draft.clone(), call.inc.parsed.max_tokens);
    let on_end: path::OnEnd = Box::new(move |end: path::StreamEnd| {
        let u = Usage {
            prompt: end.prompt_tokens.unwrap_or(prompt),
            completion: end
                .completion_tokens
                .unwrap_or_else(|| end.events.saturating_sub(1)),
            cached: 0,
        };
        story.cost += r2.book_attempt(&live2, tier, &tag, &up2.price, u);
        let outcome = match (end.whole && status.is_success(), story.escalated) {
            (false, _) => Outcome::Error,
            (true, Some(_)) => Outcome::Escalated,
            (true, None) => Outcome::Ok,
        };
        let ms = arrived.elapsed().as_secs_f64() * 1000.0;
        let rec = draft.as_ref().map(|d| CallRecord {
            draft: d,
            answer: Some((
                u.completion,
                end.first_chunk
                    .map(|t| t.saturating_duration_since(arrived).as_secs_f64() * 1e3),
            )),
            max_tokens,
        });
        r2.book_call(
            &live2,
            tier,
            &tag,
            outcome,
            ms,
            &story,
            status.as_u16(),
            rec,
        );
    });
    let sent_at = Instant::now();
    let end = call.inc.end;
    Ok(path::stream_back_with(
        &up.app,
        resp,
        Some(placed.held()),
        Some(sent_at),
        end,
        {
            placed_headers.extend(path::named(extra));
            placed_headers
        },
        Some(on_end),
    )
    .into_response())
}
