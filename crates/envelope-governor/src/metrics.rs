//! The governor's own `/metrics` (Prometheus text, names
//! `envelope_governor_*`). Gauges are set from the ledger and queue after
//! every change; counters and histograms are bumped where things happen.
//! The rejection reasons are [`crate::GovernError::reason`] labels.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;
/// One label whose value is a fixed word.
pub type Fixed = [(&'static str, &'static str); 1];

/// A counter family of one label whose values are the words of a small
/// enum (variant `i` is word `i`): each word's counter is looked up in the
/// family once, when first bumped, and kept. Every request bumps three;
/// the family's own lookup is a lock, a SipHash of the label and, before,
/// an allocated label (docs/measurements/2026-12-06-governor-code-figures.md).
pub struct WordCounters {
    pub family: Family<Fixed, Counter>,
    key: &'static str,
    words: [std::sync::OnceLock<Counter>; 4],
}

impl WordCounters {
    fn new(key: &'static str) -> WordCounters {
        WordCounters {
            family: Family::default(),
            key,
            words: Default::default(),
        }
    }

    /// Bumps the counter of `word`, variant `i` of its enum.
    pub fn inc(&self, i: usize, word: &'static str) {
        match self.words.get(i) {
            Some(slot) => slot
                .get_or_init(|| self.family.get_or_create(&[(self.key, word)]).clone())
                .inc(),
            None => self.family.get_or_create(&[(self.key, word)]).inc(),
        };
    }
}

pub struct Metrics {
    registry: Registry,
    pub in_flight_sequences: Gauge,
    pub in_flight_requests: Gauge,
    pub queued_requests: Gauge,
    pub queued_tokens: Gauge,
    pub reserved_kv_tokens: Gauge,
    pub kv_headroom_tokens: Gauge,
    pub kv_capacity_tokens: Gauge,
    pub max_concurrent_sequences: Gauge,
    pub ladder_state: Gauge,
    pub draining: Gauge,
    pub upstream_kv_usage: Gauge<f64, AtomicU64>,
    pub capacity_used: Gauge<f64, AtomicU64>,
    pub capacity_limit: Gauge<f64, AtomicU64>,
    /// The pod as an endpoint picker reads it (`crate::pod_load`), set
    /// at each scrape.
    pub pod_queued_requests: Gauge,
    pub pod_running_requests: Gauge,
    pub kv_reserved_ratio: Gauge<f64, AtomicU64>,
    pub saturation: Gauge<f64, AtomicU64>,
    pub admission_headroom: Gauge<f64, AtomicU64>,
    /// The prefix cache as the governor sees it
    /// ([`crate::prefix_cache`]): the hit rates of the last reading, the
    /// share of its estimate it credits, and the prompt tokens credited.
    pub prefix_estimated_hit_rate: Gauge<f64, AtomicU64>,
    pub prefix_observed_hit_rate: Gauge<f64, AtomicU64>,
    pub prefix_trust: Gauge<f64, AtomicU64>,
    pub prefix_estimated_tokens: Counter,
    pub prefix_credited_tokens: Counter,
    pub bucket_sequences: Family<Labels, Gauge>,
    pub bucket_capacity_used: Family<Labels, Gauge<f64, AtomicU64>>,
    pub profile_info: Family<Labels, Gauge>,
    pub rejections: Family<Labels, Counter>,
    pub admitted: WordCounters,
    pub token_counts: WordCounters,
    pub output_decisions: WordCounters,
    pub upstream_errors: Family<Labels, Counter>,
    /// Requests sent upstream on a kept connection, on a new one, and
    /// sent again after a kept one closed under them unanswered.
    pub upstream_kept_connections: Counter,
    pub upstream_new_connections: Counter,
    pub upstream_resent: Counter,
    pub reserved_tokens_settled: Counter,
    pub used_tokens_settled: Counter,
    /// `--record`: lines written, and finished requests dropped because
    /// the writer was behind (the channel full).
    pub records_written: Counter,
    pub records_dropped: Counter,
    pub reloads: Family<Labels, Counter>,
    pub queue_age: Histogram,
    pub added_latency: Histogram,
    pub ttft: Histogram,
    pub inter_chunk: Histogram,
    pub budget_refusals: Family<Labels, Counter>,
    pub budget_shadow_refusals: Family<Labels, Counter>,
    pub budget_store_errors: Family<Labels, Counter>,
    pub budget_decision: Histogram,
}

/// The one family of refusals the governor answers itself, in both modes:
/// its name and help, the same on every registry that counts them (the
/// tiers' page merges them into one family).
pub const REJECTIONS: (&str, &str) = (
    "envelope_governor_rejections",
    "Requests refused by the governor itself, by front end (mode: single, tiers) and reason",
);

pub fn label(k: &str, v: &str) -> Labels {
    vec![(k.to_string(), v.to_string())]
}

impl Metrics {
    /// The counters an upstream client bumps (shared with these metrics).
    pub fn connection_counters(&self) -> crate::client::ConnectionCounters {
        crate::client::ConnectionCounters {
            reused: self.upstream_kept_connections.clone(),
            opened: self.upstream_new_connections.clone(),
            resent: self.upstream_resent.clone(),
        }
    }

    pub fn new() -> Metrics {
        let mut m = Metrics {
            registry: Registry::default(),
            in_flight_sequences: Gauge::default(),
            in_flight_requests: Gauge::default(),
            queued_requests: Gauge::default(),
            queued_tokens: Gauge::default(),
            reserved_kv_tokens: Gauge::default(),
            kv_headroom_tokens: Gauge::default(),
            kv_capacity_tokens: Gauge::default(),
            max_concurrent_sequences: Gauge::default(),
            ladder_state: Gauge::default(),
            draining: Gauge::default(),
            upstream_kv_usage: Gauge::default(),
            capacity_used: Gauge::default(),
            capacity_limit: Gauge::default(),
            pod_queued_requests: Gauge::default(),
            pod_running_requests: Gauge::default(),
            kv_reserved_ratio: Gauge::default(),
            saturation: Gauge::default(),
            admission_headroom: Gauge::default(),
            prefix_estimated_hit_rate: Gauge::default(),
            prefix_observed_hit_rate: Gauge::default(),
            prefix_trust: Gauge::default(),
            prefix_estimated_tokens: Counter::default(),
            prefix_credited_tokens: Counter::default(),
            bucket_sequences: Family::default(),
            bucket_capacity_used: Family::default(),
            profile_info: Family::default(),
            rejections: Family::default(),
            admitted: WordCounters::new("endpoint"),
            token_counts: WordCounters::new("source"),
            output_decisions: WordCounters::new("decision"),
            upstream_errors: Family::default(),
            upstream_kept_connections: Counter::default(),
            upstream_new_connections: Counter::default(),
            upstream_resent: Counter::default(),
            reserved_tokens_settled: Counter::default(),
            used_tokens_settled: Counter::default(),
            records_written: Counter::default(),
            records_dropped: Counter::default(),
            reloads: Family::default(),
            // 50 us .. ~100 s
            queue_age: Histogram::new(exponential_buckets(0.00005, 2.0, 22)),
            added_latency: Histogram::new(exponential_buckets(0.00005, 2.0, 22)),
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 18)),
            inter_chunk: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            budget_refusals: Family::default(),
            budget_shadow_refusals: Family::default(),
            budget_store_errors: Family::default(),
            // 10 us .. ~80 ms
            budget_decision: Histogram::new(exponential_buckets(0.00001, 2.0, 14)),
        };
        let r = &mut m.registry;
        macro_rules! reg {
            ($name:expr, $help:expr, $metric:expr) => {
                r.register($name, $help, $metric.clone())
            };
        }
        reg!(
            "envelope_governor_in_flight_sequences",
            "Sequences admitted upstream and not finished",
            m.in_flight_sequences
        );
        reg!(
            "envelope_governor_in_flight_requests",
            "Requests admitted upstream and not finished",
            m.in_flight_requests
        );
        reg!(
            "envelope_governor_queued_requests",
            "Requests waiting for admission",
            m.queued_requests
        );
        reg!(
            "envelope_governor_queued_tokens",
            "KV tokens the queued requests would reserve",
            m.queued_tokens
        );
        reg!(
            "envelope_governor_reserved_kv_tokens",
            "KV tokens reserved by requests in flight",
            m.reserved_kv_tokens
        );
        reg!(
            "envelope_governor_kv_headroom_tokens",
            "KV tokens free under the current cap",
            m.kv_headroom_tokens
        );
        reg!(
            "envelope_governor_kv_capacity_tokens",
            "Current KV token cap (profile, overrides, ladder)",
            m.kv_capacity_tokens
        );
        reg!(
            "envelope_governor_max_concurrent_sequences",
            "Current concurrency cap",
            m.max_concurrent_sequences
        );
        reg!(
            "envelope_governor_ladder_state",
            "Live guard: 0 normal, 1 small_context, 2 reject_new",
            m.ladder_state
        );
        reg!(
            "envelope_governor_draining",
            "1 while draining (SIGTERM)",
            m.draining
        );
        reg!(
            "envelope_governor_upstream_kv_usage",
            "Upstream KV use (0..1) at the last reading",
            m.upstream_kv_usage
        );
        reg!(
            "envelope_governor_envelope_used",
            "Share of the measured envelope held by requests in flight (each sequence 1 / its bucket's safe concurrency)",
            m.capacity_used
        );
        reg!(
            "envelope_governor_envelope_limit",
            "Share of the envelope admitted now (1 unless the latency guard lowered it)",
            m.capacity_limit
        );
        reg!(
            "envelope_governor_pod_queued_requests",
            "Requests waiting at this pod: the governor's queue and the engine's waiting requests",
            m.pod_queued_requests
        );
        reg!(
            "envelope_governor_pod_running_requests",
            "Requests the engine runs: in flight upstream less the engine's waiting requests",
            m.pod_running_requests
        );
        reg!(
            "envelope_governor_kv_reserved_ratio",
            "KV tokens reserved over the KV budget in force (0..1)",
            m.kv_reserved_ratio
        );
        reg!(
            "envelope_governor_prefix_cache_estimated_hit_rate",
            "Share of the prompt tokens sent that the governor's record of sent prefix blocks estimated cached upstream, at the last reading (-1 before one)",
            m.prefix_estimated_hit_rate
        );
        reg!(
            "envelope_governor_prefix_cache_observed_hit_rate",
            "Share of prompt tokens the upstream reported found in its prefix cache, at the last reading (-1 before one)",
            m.prefix_observed_hit_rate
        );
        reg!(
            "envelope_governor_prefix_cache_trust",
            "Share (0..1) of the estimated cached tokens credited against compute charges: 0 until the upstream reports hits, and at once when it stops",
            m.prefix_trust
        );
        reg!(
            "envelope_governor_prefix_cache_estimated_tokens",
            "Prompt tokens of admitted requests estimated cached upstream",
            m.prefix_estimated_tokens
        );
        reg!(
            "envelope_governor_prefix_cache_credited_tokens",
            "Prompt tokens of admitted requests charged as cached (not computed) upstream",
            m.prefix_credited_tokens
        );
        reg!(
            "envelope_governor_saturation",
            "How full this pod is against its own measured limit (0..1): 1 exactly when the governor queues, refuses everything new, or would not admit a request of the profile's cheapest measured shape",
            m.saturation
        );
        reg!(
            "envelope_governor_admission_headroom",
            "Share of this pod's measured capacity free to admit (1 - saturation)",
            m.admission_headroom
        );
        reg!(
            "envelope_governor_bucket_sequences",
            "Sequences in flight, by the profile bucket they were charged to",
            m.bucket_sequences
        );
        reg!(
            "envelope_governor_bucket_envelope_used",
            "Share of the envelope held, by profile bucket",
            m.bucket_capacity_used
        );
        reg!(
            "envelope_governor_profile",
            "The enforced profile (value 1)",
            m.profile_info
        );
        // The same name and help as REJECTIONS (a test holds them equal),
        // written out so deploy/validate.py reads the registration.
        reg!(
            "envelope_governor_rejections",
            "Requests refused by the governor itself, by front end (mode: single, tiers) and reason",
            m.rejections
        );
        reg!(
            "envelope_governor_admitted",
            "Requests admitted upstream, by endpoint",
            m.admitted.family
        );
        reg!(
            "envelope_governor_token_counts",
            "Prompt token counts, by source (estimate is labelled)",
            m.token_counts.family
        );
        reg!(
            "envelope_governor_output_limit",
            "max_tokens decisions: kept, injected, clamped",
            m.output_decisions.family
        );
        reg!(
            "envelope_governor_upstream_errors",
            "Upstream failures, by kind",
            m.upstream_errors
        );
        reg!(
            "envelope_governor_upstream_requests_on_kept_connections",
            "Requests sent to the upstream on a kept-alive connection",
            m.upstream_kept_connections
        );
        reg!(
            "envelope_governor_upstream_requests_on_new_connections",
            "Requests sent to the upstream on a new connection",
            m.upstream_new_connections
        );
        reg!(
            "envelope_governor_upstream_resent",
            "Requests sent again on a new connection after a kept one closed with no answer",
            m.upstream_resent
        );
        reg!(
            "envelope_governor_reserved_tokens_settled",
            "KV tokens reserved by finished requests",
            m.reserved_tokens_settled
        );
        reg!(
            "envelope_governor_used_tokens_settled",
            "KV tokens finished requests actually used (prompt + output, when reported)",
            m.used_tokens_settled
        );
        reg!(
            "envelope_governor_records_written",
            "Finished requests written by --record",
            m.records_written
        );
        reg!(
            "envelope_governor_records_dropped",
            "Finished requests --record dropped because its writer was behind",
            m.records_dropped
        );
        reg!(
            "envelope_governor_profile_reloads",
            "Profile reloads, by outcome",
            m.reloads
        );
        reg!(
            "envelope_governor_queue_age_seconds",
            "Time admitted requests waited in the queue",
            m.queue_age
        );
        reg!(
            "envelope_governor_added_latency_seconds",
            "Arrival to upstream send (validation, counting, queue)",
            m.added_latency
        );
        reg!(
            "envelope_governor_time_to_first_chunk_seconds",
            "Upstream send to first response chunk (streams)",
            m.ttft
        );
        reg!(
            "envelope_governor_inter_chunk_seconds",
            "Gaps between response chunks (streams)",
            m.inter_chunk
        );
        reg!(
            "envelope_governor_budget_refusals",
            "Requests refused over a budget over time, by budget",
            m.budget_refusals
        );
        reg!(
            "envelope_governor_budget_shadow_refusals",
            "Requests a shadow-mode budget would have refused (they were admitted), by budget",
            m.budget_shadow_refusals
        );
        reg!(
            "envelope_governor_budget_store_errors",
            "Budget store calls that failed (decide, settle)",
            m.budget_store_errors
        );
        reg!(
            "envelope_governor_budget_decision_seconds",
            "Time of one budget decision (a Redis round trip with --budget-store)",
            m.budget_decision
        );
        m
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = encode(&mut s, &self.registry);
        s
    }

    /// Counts a refusal of the single-upstream front end.
    pub fn reject(&self, reason: &str) {
        let l = vec![
            ("mode".to_string(), "single".to_string()),
            ("reason".to_string(), reason.to_string()),
        ];
        self.rejections.get_or_create(&l).inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_with_prefix() {
        let m = Metrics::new();
        m.reject("queue_full");
        m.in_flight_sequences.set(3);
        let text = m.render();
        assert!(
            text.contains(
                "envelope_governor_rejections_total{mode=\"single\",reason=\"queue_full\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("envelope_governor_in_flight_sequences 3"));
        let (name, help) = REJECTIONS;
        assert!(text.contains(&format!("# HELP {name} {help}.\n")), "{text}");
        assert!(text.contains("envelope_governor_queue_age_seconds_bucket"));
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            assert!(line.starts_with("envelope_governor_"), "{line}");
        }
    }

    #[test]
    fn word_counters_keep_one_series_per_word() {
        let m = Metrics::new();
        m.admitted.inc(0, "completions");
        m.admitted.inc(1, "chat");
        m.admitted.inc(0, "completions");
        // Past the kept slots: still counted, through the family.
        m.admitted.inc(9, "other");
        let text = m.render();
        for line in [
            "envelope_governor_admitted_total{endpoint=\"completions\"} 2",
            "envelope_governor_admitted_total{endpoint=\"chat\"} 1",
            "envelope_governor_admitted_total{endpoint=\"other\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        // Nothing is shown before it is counted.
        assert!(
            !text.contains("envelope_governor_token_counts_total{"),
            "{text}"
        );
    }
}
