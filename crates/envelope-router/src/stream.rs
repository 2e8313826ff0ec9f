//! A streamed call passed through as it comes: no escalation once bytes
//! flow to the client; an upstream that cannot be reached (or answers a
//! 5xx head) is still retried a tier up. The call is booked, and with
//! `--record` written, when the stream ends.

use super::book::{CallRecord, Outcome, Story};
use super::check::Usage;
use super::config::Check;
use super::read_call::{upstream_failed, Call};
use super::state::{Live, TierRouter, Upstream};
use axum::response::{IntoResponse, Response};
use envelope_governor::error::GovernError;
use envelope_governor::request_path::{self as path, Placed};
use std::sync::Arc;

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
    let sent = loop {
        let settings = up.app.settings();
        let parsed = up.body_for(&call.inc.parsed);
        let prompt = placed.plan.prompt_tokens;
        let sent = up.app.send(&settings, &call.inc, &parsed, placed).await;
        // Nothing has gone to the client yet: an upstream that failed
        // (unreachable, or a 5xx head) may still be retried a tier up.
        let may = !escalated
            && !call.route.pinned
            && tier + 1 < live.tiers.len()
            && live.file.escalation.on.contains(&Check::UpstreamError);
        let failed = match sent {
            Ok(sent) if !(may && sent.status().is_server_error()) => break sent,
            Ok(sent) => {
                let status = sent.status().as_u16();
                sent.settle_unrelayed();
                GovernError::UpstreamUnreachable(format!("the upstream answered {status}"))
            }
            Err(e) => e,
        };
        let u = Usage {
            prompt,
            ..Usage::default()
        };
        story.cost += r.book_attempt(live, tier, &call.tag, &up.price, u);
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
    let status = sent.status();
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
    let prompt = sent.placed().plan.prompt_tokens;
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
    Ok(sent
        .stream_back(path::named(extra), Some(on_end))
        .into_response())
}
