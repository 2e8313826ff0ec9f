//! The pod's load as an endpoint picker reads it ([`PodLoad`]), read from
//! the bookkeeping at scrape time and set on the gauges.

use super::Governor;
use crate::ladder::Level;
use crate::ledger::units_per_sequence;
use crate::pod_load::PodLoad;
use std::sync::atomic::Ordering;

/// `engine_waiting` when no engine reading is known.
pub(super) const WAITING_UNKNOWN: u64 = u64::MAX;

impl Governor {
    /// The engine's waiting requests at its last reading (`None`: unknown,
    /// or the reading failed).
    pub fn note_engine_waiting(&self, waiting: Option<f64>) {
        let v = match waiting {
            Some(w) if w.is_finite() && w >= 0.0 => w as u64,
            _ => WAITING_UNKNOWN,
        };
        self.engine_waiting.store(v, Ordering::Relaxed);
    }

    /// A snapshot of what the pod holds against what it may take now.
    pub fn pod_load(&self) -> PodLoad {
        let settings = self.settings();
        let buckets = &settings.limits.buckets;
        let cheapest_sequence = buckets
            .iter()
            .map(crate::policy::units_of)
            .min()
            .unwrap_or(units_per_sequence(1));
        let smallest_sequence_kv = buckets
            .iter()
            .map(|b| b.input_tokens + b.output_tokens)
            .min()
            .unwrap_or(1);
        let waiting = self.engine_waiting.load(Ordering::Relaxed);
        let g = self.lock();
        let (used, cap) = (g.ledger.used(), g.ledger.capacity());
        PodLoad {
            governor_queued: g.queue.len() as u64,
            engine_waiting: (waiting != WAITING_UNKNOWN).then_some(waiting),
            in_flight: g.requests_in_flight,
            envelope_used: used.capacity,
            envelope_limit: cap.capacity,
            cheapest_sequence,
            kv_reserved: used.kv_tokens,
            kv_limit: cap.kv_tokens,
            smallest_sequence_kv,
            sequences: used.seqs,
            sequence_limit: cap.seqs,
            refusing_new: self.is_draining() || g.ladder.level() == Level::RejectNew,
        }
    }

    /// The metrics page: the pod gauges set from one [`Governor::pod_load`]
    /// and rendered before another scrape may set them again (two pickers
    /// and Prometheus scraping at once each get one reading, whole).
    pub fn render_metrics(&self) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|e| e.into_inner());
        self.publish_pod_load();
        self.metrics.render()
    }

    /// Sets the pod gauges from [`Governor::pod_load`].
    fn publish_pod_load(&self) {
        let p = self.pod_load();
        let m = &self.metrics;
        m.pod_queued_requests.set(p.queued_requests() as i64);
        m.pod_running_requests.set(p.running_requests() as i64);
        m.kv_reserved_ratio.set(p.kv_reserved_ratio());
        m.saturation.set(p.saturation());
        m.admission_headroom.set(p.admission_headroom());
        let (trust, rates) = self.prefix.trust();
        m.prefix_trust.set(trust.value);
        m.prefix_estimated_hit_rate
            .set(rates.estimated.unwrap_or(-1.0));
        m.prefix_observed_hit_rate
            .set(rates.observed.unwrap_or(-1.0));
    }
}
