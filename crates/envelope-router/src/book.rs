//! Booking: every attempt's tokens and cost, every call's outcome and
//! latency, per feature and tier (the cost book, `/metrics` and, with
//! `--record`, the call's trace line), and the features over their
//! allowance.

use super::check::Usage;
use super::config::Check;
use super::cost::Price;
use super::metrics::labels;
use super::state::{Live, TierRouter};
use envelope_governor::recorder::{Draft, Finished};
use envelope_profile::trace::TierCall;

/// Whom a call is booked to.
#[derive(Debug, Clone)]
pub struct Tag {
    pub feature: String,
    pub tenant: String,
}

/// What happened to a call, for its headers and its booking.
#[derive(Debug, Clone)]
pub struct Story {
    pub start: usize,
    pub reason: String,
    pub fell_back_from: Option<usize>,
    /// The check the first answer failed, and the tier it came from.
    pub escalated: Option<(Check, usize)>,
    /// Why the escalated attempt could not be made (the lower answer stands).
    pub escalation_failed: Option<String>,
    /// `hit`, `miss` or `off`.
    pub cache: &'static str,
    /// Every attempt's cost.
    pub cost: f64,
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Escalated,
    Cached,
    Error,
    /// Not placed anywhere (a 4xx or 429 from placement).
    Refused,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Escalated => "escalated",
            Outcome::Cached => "cached",
            Outcome::Error => "error",
            Outcome::Refused => "refused",
        }
    }
}

impl TierRouter {
    fn with_book<T>(&self, f: impl FnOnce(&mut super::cost::Book) -> T) -> T {
        let mut b = self.book.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut b)
    }

    /// Books one attempt on `tier` that used `u`; returns its cost.
    pub fn book_attempt(
        &self,
        live: &Live,
        tier: usize,
        tag: &Tag,
        price: &Price,
        u: Usage,
    ) -> f64 {
        let name = &live.tiers[tier].name;
        let cost = price.cost(u);
        self.with_book(|b| {
            let r = b.row(&tag.feature, name);
            r.attempts += 1;
            r.input_tokens += u.prompt;
            r.cached_input_tokens += u.cached.min(u.prompt);
            r.output_tokens += u.completion;
            r.cost += cost;
        });
        let m = &self.metrics;
        let cached = u.cached.min(u.prompt);
        for (kind, n) in [
            ("input", u.prompt - cached),
            ("cached_input", cached),
            ("output", u.completion),
        ] {
            m.tokens
                .get_or_create(&labels(&[
                    ("tier", name),
                    ("feature", &tag.feature),
                    ("kind", kind),
                ]))
                .inc_by(n);
        }
        m.cost
            .get_or_create(&labels(&[
                ("tier", name),
                ("feature", &tag.feature),
                ("tenant", &tag.tenant),
            ]))
            .inc_by(cost);
        cost
    }

    pub fn book_escalation(&self, live: &Live, from: usize, tag: &Tag, check: Check) {
        self.metrics
            .escalations
            .get_or_create(&labels(&[
                ("from", &live.tiers[from].name),
                ("to", &live.tiers[from + 1].name),
                ("check", check.label()),
            ]))
            .inc();
        self.with_book(|b| b.row(&tag.feature, &live.tiers[from].name).escalations += 1);
    }

    pub fn book_fallback(&self, live: &Live, from: usize, to: usize) {
        self.metrics
            .fallbacks
            .get_or_create(&labels(&[
                ("from", &live.tiers[from].name),
                ("to", &live.tiers[to].name),
            ]))
            .inc();
    }

    /// A shadow call made on `tier` (its attempt is booked as any other).
    pub fn book_shadow(&self, live: &Live, tier: usize, tag: &Tag, price: &Price, u: Usage) {
        let name = &live.tiers[tier].name;
        let cost = price.cost(u);
        self.with_book(|b| {
            let r = b.row(&tag.feature, name);
            r.shadows += 1;
            r.shadow_cost += cost;
        });
        self.metrics
            .shadow_cost
            .get_or_create(&labels(&[("tier", name), ("feature", &tag.feature)]))
            .inc_by(cost);
    }

    /// The label a feature is booked under (see [`super::cost::Book`]).
    pub fn feature_label(&self, live: &Live, feature: &str) -> String {
        let named = live.file.features.contains_key(feature)
            || live.file.rules.iter().any(|r| {
                r.features
                    .as_ref()
                    .is_some_and(|f| f.iter().any(|x| x == feature))
            });
        self.with_book(|b| b.feature_label(feature, named))
    }

    /// Books a call's end on the tier that answered (`tier`), and with
    /// `--record` writes its line (`rec`).
    #[allow(clippy::too_many_arguments)]
    pub fn book_call(
        &self,
        live: &Live,
        tier: usize,
        tag: &Tag,
        outcome: Outcome,
        ms: f64,
        story: &Story,
        status: u16,
        rec: Option<CallRecord<'_>>,
    ) {
        let name = &live.tiers[tier].name;
        let over = self.with_book(|b| {
            let row = b.row(&tag.feature, name);
            match outcome {
                Outcome::Error => {}
                Outcome::Refused => row.refusals += 1,
                _ => {
                    row.calls += 1;
                    row.latency_ms_sum += ms;
                }
            }
            if story.fell_back_from.is_some() {
                row.fallbacks += 1;
            }
            if outcome == Outcome::Cached {
                row.cache_hits += 1;
            }
            b.over_budget(&live.file.features)
        });
        self.metrics.over_budget.clear();
        for (f, _, _) in over {
            self.metrics
                .over_budget
                .get_or_create(&labels(&[("feature", &f)]))
                .set(1);
        }
        self.metrics
            .calls
            .get_or_create(&labels(&[
                ("tier", name),
                ("feature", &tag.feature),
                ("outcome", outcome.label()),
            ]))
            .inc();
        if let (Some(recorder), Some(rec)) = (self.recorder.get(), rec) {
            let mut f = match rec.answer {
                Some((output_tokens, ttft_ms)) => Finished {
                    output_tokens,
                    status,
                    ttft_ms,
                    e2e_ms: rec.draft.arrived.elapsed().as_secs_f64() * 1e3,
                    tiers: None,
                    draft: rec.draft.clone(),
                },
                None => rec.draft.clone().refused(status, rec.max_tokens),
            };
            f.tiers = Some(TierCall {
                start_tier: live.tiers[story.start].name.clone(),
                tier: name.clone(),
                reason: story.reason.clone(),
                outcome: outcome.label().into(),
                fallback_from: story.fell_back_from.map(|f| live.tiers[f].name.clone()),
                escalated: story.escalated.map(|(c, _)| c.label().into()),
                cost: story.cost,
                tiers_version: live.file.version.clone(),
                prices_version: live.file.prices_version.clone(),
            });
            recorder.record(f);
        }
    }
}

/// What `--record` writes of a call beside the book: its draft, and its
/// answer's output tokens and TTFT (None: no answer; the client's limit
/// is written).
pub struct CallRecord<'a> {
    pub draft: &'a Draft,
    pub answer: Option<(u64, Option<f64>)>,
    pub max_tokens: Option<u64>,
}
