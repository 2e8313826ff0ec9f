//! Shadow calibration: a sample of the calls a cheaper tier answered is
//! sent again, off the request path, to the next tier up, only when that
//! tier has room now (a shadow never queues and never delays a real call).
//! Whether the two answers agree (the same text, equal JSON, or the same
//! tool call, as the call asked) is counted per tier, feature and the rule
//! that routed the call, so a threshold moves in measured steps. Their
//! spend is booked apart (`shadow_cost`), not in the features' cost per
//! call.

use super::book::Tag;
use super::check::{read_answer, Agreement, AssembledAnswer, Expect, Usage};
use super::metrics::labels;
use super::state::{Agreement as Tally, Live, TierRouter};
use envelope_governor::identity::Identity;
use envelope_governor::request_path::Incoming;
use std::sync::Arc;

/// Maybe sends a shadow of the call `inc` that tier `tier` answered with
/// `answer`.
#[allow(clippy::too_many_arguments)]
pub(super) fn maybe(
    r: &Arc<TierRouter>,
    live: &Arc<Live>,
    inc: &Incoming,
    who: &Identity,
    tag: &Tag,
    reason: &str,
    expect: &Expect,
    tier: usize,
    answer: &AssembledAnswer,
) {
    let sample = live.file.shadow.sample;
    if sample <= 0.0 || tier + 1 >= live.tiers.len() || rand::random::<f64>() >= sample {
        return;
    }
    let key = (
        live.tiers[tier].name.clone(),
        tag.feature.clone(),
        reason.to_string(),
    );
    let Some(slot) = r.shadow_slot() else {
        tally(r, key, None);
        return;
    };
    let (r, live) = (r.clone(), live.clone());
    let (inc, who, tag) = (inc.detached(), who.clone(), tag.clone());
    let (expect, answer) = (expect.clone(), answer.clone());
    tokio::spawn(async move {
        let _slot = slot;
        let agreed = shadow(&r, &live, &inc, &who, &tag, &expect, tier + 1, &answer).await;
        tally(&r, key, agreed);
    });
}

#[allow(clippy::too_many_arguments)]
async fn shadow(
    r: &TierRouter,
    live: &Live,
    inc: &Incoming,
    who: &Identity,
    tag: &Tag,
    expect: &Expect,
    up_tier: usize,
    answer: &AssembledAnswer,
) -> Option<bool> {
    for up in live.by_room(up_tier) {
        let settings = up.app.settings();
        let Ok(counted) = up.app.count(&settings, &inc.parsed).await else {
            continue;
        };
        let Ok(Some(placed)) = up
            .app
            .try_place(&settings, inc, &counted, who, inc.deadline)
            .await
        else {
            continue;
        };
        let parsed = up.body_for(&inc.parsed);
        let prompt = placed.plan.prompt_tokens;
        let got = match up.app.send(&settings, inc, &parsed, placed).await {
            Ok(sent) => sent.collect().await,
            Err(e) => Err(e),
        };
        let Ok(got) = got else {
            return None;
        };
        let theirs = read_answer(&got.body, got.sse);
        let u = theirs.as_ref().and_then(|a| a.usage).unwrap_or(Usage {
            prompt,
            ..Usage::default()
        });
        r.book_shadow(live, up_tier, tag, &up.price, u);
        if !got.status.is_success() {
            return None;
        }
        return Some(Agreement::of(expect).agree(answer, &theirs?));
    }
    None
}

/// Counts one comparison (`Some(agreed)`) or a skipped shadow (`None`).
fn tally(r: &TierRouter, key: (String, String, String), agreed: Option<bool>) {
    let (tier, feature, reason) = &key;
    let label = match agreed {
        Some(true) => "yes",
        Some(false) => "no",
        None => "skipped",
    };
    r.metrics
        .shadow
        .get_or_create(&labels(&[
            ("tier", tier),
            ("feature", feature),
            ("reason", reason),
            ("agreed", label),
        ]))
        .inc();
    let mut s = r.shadow.lock().unwrap_or_else(|e| e.into_inner());
    let t: &mut Tally = s.entry(key).or_default();
    match agreed {
        Some(a) => {
            t.compared += 1;
            t.agreed += u64::from(a);
        }
        None => t.skipped += 1,
    }
}
