//! Budgets over time (`--budgets`): requests, input tokens and output
//! tokens per minute and cost units per day, per tenant and per feature
//! tag, on top of what is in flight. A request reserves at admission what
//! it could use at most (1 request, its counted prompt, max_tokens x
//! sequences, their cost: the same figures as its KV reservation), is
//! settled with what it used when it ends, and is refunded when the
//! upstream fails before answering. Charging after the answer lets a
//! stream overrun the limit (as Envoy AI Gateway's own example shows);
//! reserving first means an admitted stream never does.
//!
//! Layers: [`bucket`] (the arithmetic) <- [`store`] (in process, or Redis
//! shared by replicas) <- this module (what a request reserves, its
//! [`Hold`], the errors and `x-ratelimit-*` headers) <- the proxy.

pub mod bucket;
pub mod config;
pub mod store;

pub use config::{Budgets, Kind, Mode, OnStoreError};
pub use store::Store;

use crate::error::GovernError;
use crate::metrics::{label, Metrics};
use bucket::Withdrawal;
use std::sync::Arc;
use std::time::Instant;
use store::Slot;

/// What a request asks of its budgets (one request besides these).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Amounts {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cost: f64,
}

impl Amounts {
    /// What a request reserves: its prompt, `max_tokens` for each of `seqs`
    /// sequences, and their cost under `budgets`' price.
    pub fn of_request(
        budgets: &Budgets,
        prompt_tokens: u64,
        max_tokens: u64,
        seqs: u64,
    ) -> Amounts {
        let output_tokens = max_tokens.saturating_mul(seqs);
        Amounts {
            input_tokens: prompt_tokens,
            output_tokens,
            cost: budgets.price.cost(crate::price::Usage {
                prompt: prompt_tokens,
                completion: output_tokens,
                cached: 0,
            }),
        }
    }
}

/// One bucket of one budget in a request's decision.
#[derive(Debug, Clone)]
struct Line {
    slot: Slot,
    kind: Kind,
    label: String,
    closed: bool,
}

fn amount(kind: Kind, a: &Amounts) -> f64 {
    match kind {
        Kind::Requests => 1.0,
        Kind::InputTokens => a.input_tokens as f64,
        Kind::OutputTokens => a.output_tokens as f64,
        Kind::Cost => a.cost,
    }
}

fn lines(b: &Budgets, tenant: &str, feature: Option<&str>, a: &Amounts) -> Vec<Line> {
    let mut out = Vec::new();
    for (rule, owner) in b.rules_for(tenant, feature) {
        for &(kind, capacity) in &rule.limits {
            out.push(Line {
                slot: Slot {
                    key: format!("{owner}:{}", kind.key()),
                    ask: Withdrawal {
                        capacity,
                        window_ms: kind.window_ms(),
                        amount: amount(kind, a),
                        shadow: rule.mode == Mode::Shadow,
                    },
                },
                kind,
                label: rule.label(kind),
                closed: rule.on_store_error == OnStoreError::Closed,
            });
        }
    }
    out
}

/// `x-ratelimit-*` headers (OpenAI's names; `-tokens` is the token budget
/// with the least left, and input, output and cost have their own).
fn headers(lines: &[Line], levels: &[f64]) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let mut tightest: Option<(f64, f64, u64)> = None;
    for kind in Kind::ALL {
        // The tightest bucket of this kind (tenant or feature).
        let Some((l, level)) = lines
            .iter()
            .zip(levels)
            .filter(|(l, _)| l.kind == kind && !l.slot.ask.shadow)
            .min_by(|a, b| a.1.total_cmp(b.1))
        else {
            continue;
        };
        let (cap, win) = (l.slot.ask.capacity, l.slot.ask.window_ms);
        let reset = bucket::reset_ms(*level, cap, win);
        let [limit, remaining, reset_name] = match kind {
            Kind::Requests => [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
            ],
            Kind::InputTokens => [
                "x-ratelimit-limit-input-tokens",
                "x-ratelimit-remaining-input-tokens",
                "x-ratelimit-reset-input-tokens",
            ],
            Kind::OutputTokens => [
                "x-ratelimit-limit-output-tokens",
                "x-ratelimit-remaining-output-tokens",
                "x-ratelimit-reset-output-tokens",
            ],
            Kind::Cost => [
                "x-ratelimit-limit-cost",
                "x-ratelimit-remaining-cost",
                "x-ratelimit-reset-cost",
            ],
        };
        let shown = |v: f64| {
            if kind == Kind::Cost {
                format!("{v:.6}")
            } else {
                format!("{}", v.max(0.0).floor())
            }
        };
        out.push((limit, shown(cap)));
        out.push((remaining, shown(level.max(0.0))));
        out.push((reset_name, duration(reset)));
        if matches!(kind, Kind::InputTokens | Kind::OutputTokens)
            && tightest.is_none_or(|(t, _, _)| *level < t)
        {
            tightest = Some((*level, cap, reset));
        }
    }
    if let Some((level, cap, reset)) = tightest {
        out.push(("x-ratelimit-limit-tokens", format!("{}", cap.floor())));
        out.push((
            "x-ratelimit-remaining-tokens",
            format!("{}", level.max(0.0).floor()),
        ));
        out.push(("x-ratelimit-reset-tokens", duration(reset)));
    }
    out
}

/// A duration as OpenAI writes its resets: `1m30s`, `6s`, `250ms`.
pub fn duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = ms.div_ceil(1000);
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if s > 0 || out.is_empty() {
        out.push_str(&format!("{s}s"));
    }
    out
}

/// What a request used, to settle its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Used {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// A reservation against budgets, held while the request runs. Dropped
/// unsettled before the request was sent (refused by the queue), it gives
/// everything back; once sent, the upstream may have done the work (a
/// client that gave up before the answer, a timeout), so it keeps it all
/// unless [`Hold::refund`] says the upstream was never reached.
pub struct Hold {
    store: Arc<Store>,
    lines: Vec<Line>,
    /// Buckets that took their amount (shadow ones that would have
    /// refused took nothing).
    took: Vec<bool>,
    reserved: Amounts,
    price: crate::price::Price,
    headers: Vec<(&'static str, String)>,
    metrics_settle_errors: prometheus_client::metrics::counter::Counter,
    done: bool,
    sent: std::sync::atomic::AtomicBool,
}

impl Hold {
    /// The `x-ratelimit-*` headers as of the decision.
    pub fn headers(&self) -> &[(&'static str, String)] {
        &self.headers
    }

    /// What was reserved.
    pub fn reserved(&self) -> Amounts {
        self.reserved
    }

    /// The request goes upstream now: from here a drop keeps everything.
    pub fn mark_sent(&self) {
        self.sent.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Gives everything back (the upstream was never reached).
    pub fn refund(mut self) {
        self.give_back(None);
    }

    /// The upstream refused the request (a non-2xx answer): the request
    /// counts, its tokens go back.
    pub fn refused_upstream(self) {
        self.settle(Used::default());
    }

    /// Settles with what the request used: the rest goes back (usage over
    /// the reservation, possible only for a prompt counted low, is taken).
    pub fn settle(mut self, used: Used) {
        let cost = self.price.cost(crate::price::Usage {
            prompt: used.input_tokens,
            completion: used.output_tokens,
            cached: 0,
        });
        let spent = Amounts {
            input_tokens: used.input_tokens,
            output_tokens: used.output_tokens,
            cost,
        };
        self.give_back(Some(spent));
    }

    fn give_back(&mut self, spent: Option<Amounts>) {
        if self.done {
            return;
        }
        self.done = true;
        let deltas: Vec<(Slot, f64)> = self
            .lines
            .iter()
            .zip(&self.took)
            .filter(|(_, &took)| took)
            .filter_map(|(l, _)| {
                let d = match spent {
                    // Refund: everything, the request too.
                    None => l.slot.ask.amount,
                    Some(_) if l.kind == Kind::Requests => 0.0,
                    Some(s) => l.slot.ask.amount - amount(l.kind, &s),
                };
                (d != 0.0).then(|| (l.slot.clone(), d))
            })
            .collect();
        if deltas.is_empty() || self.store.settle_now(&deltas) {
            return;
        }
        let store = self.store.clone();
        let errors = self.metrics_settle_errors.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(async move {
                    if let Err(e) = store.settle(&deltas).await {
                        errors.inc();
                        tracing::warn!("budget store: a settlement was lost: {e}");
                    }
                });
            }
            Err(_) => {
                errors.inc();
                tracing::warn!("budget store: a settlement was lost: no runtime");
            }
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.sent.load(std::sync::atomic::Ordering::Acquire) {
            // Sent, never settled: charged what was reserved.
            self.done = true;
        }
        self.give_back(None);
    }
}

/// Reserves `a` for a request of `tenant` with `feature`; `Ok(None)` when
/// no budget applies (or the store is away and every budget fails open).
///
/// # Errors
/// 400 when the request is larger than a budget could ever hold; 429 with
/// Retry-After (the refill time) over budget; 503 when the store cannot
/// be reached and a budget fails closed.
pub async fn reserve(
    store: &Arc<Store>,
    budgets: &Budgets,
    metrics: &Metrics,
    tenant: &str,
    feature: Option<&str>,
    a: Amounts,
) -> Result<Option<Hold>, GovernError> {
    let lines = lines(budgets, tenant, feature, &a);
    if lines.is_empty() {
        return Ok(None);
    }
    for l in &lines {
        let ask = &l.slot.ask;
        if ask.amount > ask.capacity {
            if ask.shadow {
                continue;
            }
            return Err(GovernError::OverBudgetForever(format!(
                "this request needs {} of the budget {} but it holds at most {}: it can never be admitted (lower max_tokens or the prompt)",
                fmt_amount(l.kind, ask.amount),
                l.label,
                fmt_amount(l.kind, ask.capacity),
            )));
        }
    }
    let slots: Vec<Slot> = lines.iter().map(|l| l.slot.clone()).collect();
    let t0 = Instant::now();
    let decided = store.decide(&slots).await;
    metrics.budget_decision.observe(t0.elapsed().as_secs_f64());
    let o = match decided {
        Ok(o) => o,
        Err(e) => {
            metrics
                .budget_store_errors
                .get_or_create(&label("op", "decide"))
                .inc();
            let closed: Vec<&str> = lines
                .iter()
                .filter(|l| l.closed && !l.slot.ask.shadow)
                .map(|l| l.label.as_str())
                .collect();
            tracing::warn!(
                "budget store {} unreachable ({e}): {}",
                store.describe(),
                if closed.is_empty() {
                    "admitting (every budget of this request fails open)".to_string()
                } else {
                    format!("refusing (fails closed: {})", closed.join(", "))
                }
            );
            if closed.is_empty() {
                return Ok(None);
            }
            return Err(GovernError::BudgetStoreDown);
        }
    };
    let headers = headers(&lines, &o.levels);
    for (l, &w) in lines.iter().zip(&o.would_refuse) {
        if w {
            metrics
                .budget_shadow_refusals
                .get_or_create(&label("budget", &l.label))
                .inc();
        }
    }
    if !o.admitted {
        let l = &lines[o.refusing.unwrap_or(0)];
        metrics
            .budget_refusals
            .get_or_create(&label("budget", &l.label))
            .inc();
        return Err(GovernError::OverRate {
            kind: match l.kind {
                Kind::Requests => "requests",
                Kind::InputTokens | Kind::OutputTokens => "tokens",
                Kind::Cost => "cost",
            },
            message: format!(
                "over the budget {} (asked {}, {} left): retry in {}",
                l.label,
                fmt_amount(l.kind, l.slot.ask.amount),
                fmt_amount(l.kind, o.levels[o.refusing.unwrap_or(0)].max(0.0)),
                duration(o.wait_ms)
            ),
            retry_after_ms: o.wait_ms,
            headers,
        });
    }
    let took = o.would_refuse.iter().map(|w| !w).collect();
    Ok(Some(Hold {
        store: store.clone(),
        lines,
        took,
        reserved: a,
        price: budgets.price,
        headers,
        metrics_settle_errors: metrics
            .budget_store_errors
            .get_or_create(&label("op", "settle"))
            .clone(),
        done: false,
        sent: std::sync::atomic::AtomicBool::new(false),
    }))
}

fn fmt_amount(kind: Kind, v: f64) -> String {
    match kind {
        Kind::Requests => format!("{} requests", v.floor()),
        Kind::InputTokens => format!("{} input tokens", v.floor()),
        Kind::OutputTokens => format!("{} output tokens", v.floor()),
        Kind::Cost => format!("{v:.6} cost units"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resets_are_written_as_openai_writes_them() {
        assert_eq!(duration(250), "250ms");
        assert_eq!(duration(6_000), "6s");
        assert_eq!(duration(6_001), "7s");
        assert_eq!(duration(90_000), "1m30s");
        assert_eq!(duration(3_600_000), "1h");
        assert_eq!(duration(0), "0ms");
    }
}
