//! `/metrics` in Prometheus text. Names follow vLLM's (`vllm:` becomes
//! `envelope:`) so dashboards and the telemetry adapters carry over.

use crate::error::ApiError;
use envelope_engine::EngineMetrics;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub struct ServerMetrics {
    registry: Registry,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge<f64, AtomicU64>,
    kv_blocks_total: Gauge,
    kv_capacity_tokens: Gauge,
    preemptions: Counter,
    step_panics: Counter,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    pub requests_success: Counter,
    requests_error: Family<ReasonLabel, Counter>,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    engine: Arc<EngineMetrics>,
}

/// Metric names, listed in docs/serve.md.
pub const NAMES: &[&str] = &[
    "envelope:num_requests_running",
    "envelope:num_requests_waiting",
    "envelope:kv_cache_usage_perc",
    "envelope:kv_cache_blocks_total",
    "envelope:kv_cache_capacity_tokens",
    "envelope:num_preemptions_total",
    "envelope:engine_step_panics_total",
    "envelope:prompt_tokens_total",
    "envelope:generation_tokens_total",
    "envelope:request_success_total",
    "envelope:request_error_total",
    "envelope:time_to_first_token_seconds",
    "envelope:inter_token_latency_seconds",
    "envelope:e2e_request_latency_seconds",
];

/// The reasons a request fails with after admission ([`ApiError::reason`]).
const AFTER_ADMISSION: [&str; 2] = ["engine_error", "shut_down"];

/// The `reason` label of `envelope:request_error_total`: an [`ApiError`]'s.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

impl ServerMetrics {
    /// Counts a request that failed after admission under its reason, and
    /// logs it; returns the error to send.
    pub fn failed(&self, e: ApiError) -> ApiError {
        self.requests_error
            .get_or_create(&ReasonLabel { reason: e.reason() })
            .inc();
        tracing::warn!(reason = e.reason(), "request failed: {}", e.message());
        e
    }

    pub fn new(engine: Arc<EngineMetrics>, kv_capacity_tokens: usize) -> ServerMetrics {
        let mut registry = Registry::default();
        let m = ServerMetrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            kv_capacity_tokens: Gauge::default(),
            preemptions: Counter::default(),
            step_panics: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            requests_success: Counter::default(),
            requests_error: {
                // Every reason a request can fail with after admission is
                // exported from the start, at 0: a family without samples
                // is not valid Prometheus text to every parser (the
                // telemetry adapters' refuses it, and the governor's live
                // guard then goes blind).
                let f: Family<ReasonLabel, Counter> = Family::default();
                for reason in AFTER_ADMISSION {
                    drop(f.get_or_create(&ReasonLabel { reason }));
                }
                f
            },
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 18)),
            itl: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            e2e: Histogram::new(exponential_buckets(0.01, 2.0, 16)),
            engine,
            registry: Registry::default(),
        };
        registry.register(
            "envelope:num_requests_running",
            "Sequences in the running batch",
            m.running.clone(),
        );
        registry.register(
            "envelope:num_requests_waiting",
            "Sequences waiting to be scheduled",
            m.waiting.clone(),
        );
        registry.register(
            "envelope:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0..1)",
            m.kv_usage.clone(),
        );
        registry.register(
            "envelope:kv_cache_blocks_total",
            "KV-cache blocks in the pool",
            m.kv_blocks_total.clone(),
        );
        m.kv_capacity_tokens.set(kv_capacity_tokens as i64);
        registry.register(
            "envelope:kv_cache_capacity_tokens",
            "Tokens the KV-cache pool holds (blocks x block size)",
            m.kv_capacity_tokens.clone(),
        );
        registry.register(
            "envelope:num_preemptions",
            "Sequences preempted (recompute)",
            m.preemptions.clone(),
        );
        registry.register(
            "envelope:engine_step_panics",
            "Engine steps that panicked; their requests failed with a 500, the engine went on",
            m.step_panics.clone(),
        );
        registry.register(
            "envelope:prompt_tokens",
            "Prompt tokens received",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "envelope:generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "envelope:request_success",
            "Requests finished",
            m.requests_success.clone(),
        );
        registry.register(
            "envelope:request_error",
            "Requests that failed after admission, by reason",
            m.requests_error.clone(),
        );
        registry.register(
            "envelope:time_to_first_token_seconds",
            "Time to first token",
            m.ttft.clone(),
        );
        registry.register(
            "envelope:inter_token_latency_seconds",
            "Time between tokens",
            m.itl.clone(),
        );
        registry.register(
            "envelope:e2e_request_latency_seconds",
            "Request latency",
            m.e2e.clone(),
        );
        ServerMetrics { registry, ..m }
    }

    /// Reads the engine's counters and renders the exposition text.
    pub fn render(&self) -> String {
        let e = &self.engine;
        self.running.set(e.running.load(Ordering::Relaxed) as i64);
        self.waiting.set(e.waiting.load(Ordering::Relaxed) as i64);
        self.kv_usage.set(e.kv_usage());
        self.kv_blocks_total
            .set(e.kv_blocks_total.load(Ordering::Relaxed) as i64);
        let catch_up = |c: &Counter, v: u64| {
            let now = c.get();
            if v > now {
                c.inc_by(v - now);
            }
        };
        catch_up(
            &self.preemptions,
            e.preemptions_total.load(Ordering::Relaxed),
        );
        catch_up(
            &self.step_panics,
            e.step_panics_total.load(Ordering::Relaxed),
        );
        catch_up(
            &self.prompt_tokens,
            e.prompt_tokens_total.load(Ordering::Relaxed),
        );
        catch_up(
            &self.generation_tokens,
            e.generation_tokens_total.load(Ordering::Relaxed),
        );
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
