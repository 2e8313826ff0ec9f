//! The governor over time: live-guard readings, hot reload, upstream
//! errors and added latency noted by the proxy, and the drain at SIGTERM
//! (queued requests refused, in-flight ones given until the drain timeout,
//! then cut).

use super::{burst_floor, full_capacity, latency_guard, Governor};
use crate::error::GovernError;
use crate::ladder::{Level, Reading};
use crate::ledger::Demand;
use crate::settings::Settings;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

impl Governor {
    /// Feeds a live-guard reading; applies the ladder's caps.
    pub fn observe(self: &Arc<Self>, r: Reading) -> Level {
        if let Some(kv) = r.kv_usage {
            self.metrics.upstream_kv_usage.set(kv);
            self.last_upstream_kv_milli
                .store((kv * 1000.0) as u64, Ordering::Relaxed);
        }
        let errors = self.upstream_errors.load(Ordering::Relaxed);
        let seen = self.upstream_errors_seen.swap(errors, Ordering::Relaxed);
        let r = Reading {
            now_ms: self.now_ms(),
            upstream_errors: errors.saturating_sub(seen),
            ..r
        };
        let (before, after, wakes) = {
            let mut g = self.lock();
            let before = g.ladder.level();
            let after = g.ladder.observe(r);
            self.apply_caps(&mut g);
            let w = self.pump(&mut g);
            self.publish(&g);
            (before, after, w)
        };
        if before != after {
            tracing::warn!(
                from = before.label(),
                to = after.label(),
                "live guard moved"
            );
        }
        Self::wake(wakes);
        after
    }

    /// Swaps in new settings (hot reload); in-flight reservations stay.
    pub fn reload(self: &Arc<Self>, settings: Settings) {
        let wakes = {
            let mut g = self.lock();
            *self.settings.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(settings);
            let s = self.settings();
            g.queue
                .set_bounds(s.queue.max_queue_len, s.queue.max_queue_tokens);
            g.ledger.set_full_capacity(full_capacity(&s.limits));
            g.ledger.set_min_burst_capacity(burst_floor(&s));
            g.ledger.set_shares(s.shares(), s.tenants.default_burst);
            g.queue.set_weights(s.tenants.weights());
            // In-flight requests keep their charges: a table of another
            // length keeps the counts it can and releases saturate.
            let rows = s.limits.buckets.len() + 1;
            g.buckets.resize(rows, Demand::default());
            g.latency = latency_guard(&s);
            // Rows of the old table must not linger in /metrics.
            self.metrics.bucket_sequences.clear();
            self.metrics.bucket_capacity_used.clear();
            g.bucket_gauges = super::bucket_gauges(&self.metrics, &s);
            self.apply_caps(&mut g);
            let w = self.pump(&mut g);
            self.publish(&g);
            w
        };
        self.set_profile_label();
        Self::wake(wakes);
    }

    /// The proxy saw the upstream fail (the live guard counts these).
    pub fn note_upstream_error(&self) {
        self.upstream_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// An upstream failure of `kind` the proxy answers for: counted in
    /// the `upstream_errors` metric and for the live guard.
    pub(crate) fn upstream_failed(&self, kind: &'static str) {
        self.metrics
            .upstream_errors
            .get_or_create(&crate::metrics::label("kind", kind))
            .inc();
        self.note_upstream_error();
    }

    /// Records the time from arrival to the upstream send.
    pub fn note_added_latency(&self, d: Duration) {
        self.metrics.added_latency.observe(d.as_secs_f64());
        let us = (d.as_micros() as u64).max(1);
        let mut h = self
            .added_latency_us
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let _ = h.record(us.min(600_000_000));
    }

    /// Admits nothing more: new requests and every queued one get 503
    /// with a Retry-After; in-flight requests go on.
    pub fn start_draining(self: &Arc<Self>) {
        self.draining.store(true, Ordering::Release);
        self.metrics.draining.set(1);
        let queued = {
            let mut g = self.lock();
            let q = g.queue.take_all();
            self.publish(&g);
            q
        };
        for e in queued {
            let _ = e.payload.0.send(Err(GovernError::Draining));
        }
    }

    /// A receiver that turns true when in-flight responses must end.
    pub fn cut_signal(&self) -> watch::Receiver<bool> {
        self.cut.subscribe()
    }

    /// Ends every response still streaming (an SSE error event, or a cut
    /// connection for a non-streaming one); their reservations release.
    pub fn cut_in_flight(&self) {
        self.cut.send_replace(true);
    }

    /// SIGTERM: stop admitting, let in-flight requests finish for up to
    /// `timeout`, then cut what is left. True when everything finished in time.
    pub async fn drain(self: &Arc<Self>, timeout: Duration) -> bool {
        self.start_draining();
        if self.wait_idle(timeout).await {
            return true;
        }
        tracing::warn!(
            "drain timeout: {} requests still in flight are cut",
            self.requests_in_flight()
        );
        self.cut_in_flight();
        self.wait_idle(Duration::from_secs(5)).await;
        false
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn requests_in_flight(&self) -> u64 {
        self.lock().requests_in_flight
    }

    /// Waits until nothing is in flight or `timeout` passes; true when idle.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            let notified = self.idle.notified();
            if self.requests_in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(end.into(), notified).await.is_err() {
                return self.requests_in_flight() == 0;
            }
        }
    }
}
