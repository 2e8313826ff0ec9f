//! `/admin/state`: what the governor holds and why, as JSON.

use super::{Governor, CAPACITY_UNITS};
use crate::policy::effective_limits;
use serde_json::json;
use std::time::Instant;

impl Governor {
    /// The admin `state` document.
    pub fn state_json(&self) -> serde_json::Value {
        let s = self.settings();
        let mut g = self.lock();
        let now_ms = self.now_ms();
        let used = g.ledger.used();
        let cap = g.ledger.capacity();
        // Per bucket: what is in flight, and what share of the node it holds.
        let buckets: Vec<serde_json::Value> = g
            .buckets
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let row = s.limits.buckets.get(i);
                json!({
                    "bucket": row.map(|b| b.label()).unwrap_or_else(|| "beyond".into()),
                    "safe_concurrency": row.map(|b| b.safe_concurrency),
                    "ttft_p95_ms": row.and_then(|b| b.ttft_p95_ms),
                    "sequences": d.seqs,
                    "envelope_share": d.capacity as f64 / CAPACITY_UNITS as f64,
                })
            })
            .collect();
        let added = {
            let h = self
                .added_latency_us
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            json!({"count": h.len(), "p50": h.value_at_quantile(0.5),
                   "p99": h.value_at_quantile(0.99), "max": h.max()})
        };
        json!({
            "profile_id": s.profile_id,
            "draining": self.is_draining(),
            "ladder": {"level": g.ladder.level().label(), "cause": g.ladder.cause},
            "limits": effective_limits(&s.limits, g.ladder.level(), s.ladder.small_context_factor),
            "profile_limits": s.limits,
            "in_flight": {"requests": g.requests_in_flight, "sequences": used.seqs, "kv_tokens": used.kv_tokens,
                          "envelope_share": used.capacity as f64 / CAPACITY_UNITS as f64},
            "capacity": {"sequences": cap.seqs, "kv_tokens": cap.kv_tokens,
                         "envelope_share": cap.capacity as f64 / CAPACITY_UNITS as f64},
            "buckets": buckets,
            "latency_guard": {
                "active": s.latency.active(),
                "share": g.latency.fraction(),
                "floor": g.latency.floor(),
                "cause": g.latency.cause,
                "slo": {"ttft_p95_ms": s.latency.ttft_slo_ms, "itl_p95_ms": s.latency.itl_slo_ms,
                        "e2e_ms": s.latency.e2e_slo_ms},
                "observed": {"samples": g.latency.last.samples, "ttft_p95_ms": g.latency.last.ttft_p95_ms,
                             "itl_p95_ms": g.latency.last.itl_p95_ms, "e2e_p95_ms": g.latency.last.e2e_p95_ms},
            },
            "queue": {"requests": g.queue.len(), "kv_tokens": g.queue.queued_tokens(),
                      "oldest_age_ms": g.queue.oldest_age_ms(Instant::now())},
            "drain_rate_tokens_per_s": g.drain.rate_tokens_per_s(now_ms),
            "service_ms": g.drain.service_ms(),
            "added_latency_us": added,
            "prefix_cache": self.prefix.state_json(),
        })
    }
}
