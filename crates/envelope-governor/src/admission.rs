//! The thin async layer over the bookkeeping: one `Mutex` around the ledger,
//! queue, ladder and drain estimator (held for microseconds, never across an
//! await), a `oneshot` per queued request to wake it with its permit, and
//! [`Permit`], whose `Drop` gives the reservation back, so a request that
//! finishes, fails, or whose client disconnects (the response body is
//! dropped) always releases, and releasing admits whoever now fits.

use crate::drain::{retry_after_from_ms, DrainEstimator};
use crate::error::{GovernError, OverloadReason};
use crate::ladder::{Ladder, Level};
use crate::latency::{LatencyGuard, Sample};
use crate::ledger::{units_per_sequence, Demand, Ledger, CAPACITY_UNITS};
use crate::metrics::Metrics;
use crate::policy::{effective_limits, BucketCharge};
use crate::prefix_cache::{PrefixCache, Record};
use crate::queue::{AdmissionQueue, Class};
use crate::settings::OverBudget;
use crate::settings::Settings;
use decide::{decide, ttft_budget_ms, Decision, QueueBound, Shed, Snapshot, Terms};
use envelope_profile::Limits;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch, Notify};

type Waker = oneshot::Sender<Result<Permit, GovernError>>;
/// What a queued request leaves in the queue: its wake-up and its charges.
type Waiting = (Waker, Vec<BucketCharge>);

struct Inner {
    ledger: Ledger,
    queue: AdmissionQueue<Waiting>,
    ladder: Ladder,
    latency: LatencyGuard,
    drain: DrainEstimator,
    requests_in_flight: u64,
    /// Per bucket of the profile's table (and one more for requests past
    /// it admitted alone): sequences and capacity units in flight.
    buckets: Vec<Demand>,
    /// Their gauges, looked up once per table (not per request).
    bucket_gauges: Vec<BucketGauges>,
}

type BucketGauges = (
    prometheus_client::metrics::gauge::Gauge,
    prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
);

/// The per-bucket gauges of a profile's table (rows, then `beyond`).
fn bucket_gauges(m: &Metrics, s: &Settings) -> Vec<BucketGauges> {
    (0..=s.limits.buckets.len())
        .map(|i| {
            let name = s
                .limits
                .buckets
                .get(i)
                .map(|b| b.label())
                .unwrap_or_else(|| "beyond".into());
            let l = crate::metrics::label("bucket", &name);
            (
                m.bucket_sequences.get_or_create(&l).clone(),
                m.bucket_capacity_used.get_or_create(&l).clone(),
            )
        })
        .collect()
}

/// The capacity a profile's limits give the ledger: its sequence and KV
/// caps, and the whole node in capacity units.
fn full_capacity(l: &Limits) -> Demand {
    Demand {
        seqs: l.max_concurrent_seqs,
        kv_tokens: l.max_kv_tokens_in_flight,
        capacity: CAPACITY_UNITS,
    }
}

/// The least burst ceiling of any tenant, in capacity units: one sequence
/// of the costliest shape admitted (the whole node when requests past the
/// table are admitted alone).
fn burst_floor(s: &Settings) -> u64 {
    if s.beyond == crate::settings::Beyond::Alone {
        CAPACITY_UNITS
    } else {
        costliest_sequence(s)
    }
}

/// Capacity units of one sequence of the most expensive bucket.
fn costliest_sequence(s: &Settings) -> u64 {
    s.limits
        .buckets
        .iter()
        .map(crate::policy::units_of)
        .max()
        .unwrap_or(units_per_sequence(1))
}

/// The latency guard's floor: one sequence of the most expensive bucket,
/// so every shape the profile admits can still run.
fn latency_guard(s: &Settings) -> LatencyGuard {
    let floor = costliest_sequence(s) as f64 / CAPACITY_UNITS as f64;
    LatencyGuard::new(s.latency.clone(), floor)
}

pub struct Governor {
    inner: Mutex<Inner>,
    settings: RwLock<Arc<Settings>>,
    pub metrics: Metrics,
    draining: AtomicBool,
    idle: Notify,
    epoch: Instant,
    last_upstream_kv_milli: AtomicU64,
    /// The engine's waiting requests at its last reading
    /// (`pod_load::WAITING_UNKNOWN` when none).
    engine_waiting: AtomicU64,
    /// Held while a scrape sets the pod gauges and renders the page.
    scrape: Mutex<()>,
    upstream_errors: AtomicU64,
    upstream_errors_seen: AtomicU64,
    /// Arrival to upstream send, microseconds (HDR: exact percentiles for /admin/state).
    added_latency_us: Mutex<hdrhistogram::Histogram<u64>>,
    /// Set at the drain timeout: every response still streaming ends.
    cut: watch::Sender<bool>,
    /// What the upstream's prefix cache probably holds of a prompt, and
    /// how far the upstream's own reports let the charges believe it.
    pub prefix: PrefixCache,
}

/// What a request asks the governor for.
#[derive(Debug, Clone)]
pub struct Ask {
    pub tenant: String,
    pub class: Class,
    /// When the request must be finished (arrival + deadline).
    pub deadline: Instant,
    pub demand: Demand,
    /// The demand per bucket of the envelope (for the per-bucket gauges).
    pub charges: Vec<BucketCharge>,
    /// The profile's TTFT p95 for the most expensive bucket charged, ms.
    pub expected_ttft_ms: Option<f64>,
    /// The request's own TTFT objective (an endpoint picker's header), ms:
    /// its budget where tighter than its class's.
    pub ttft_objective_ms: Option<f64>,
}

/// A reservation in flight. Dropping it releases it.
pub struct Permit {
    gov: Arc<Governor>,
    tenant: String,
    demand: Demand,
    charges: Vec<BucketCharge>,
    pub admitted_at: Instant,
    admitted_ms: u64,
    pub queued_for: Duration,
    used_tokens: Option<u64>,
}

impl Permit {
    pub fn demand(&self) -> Demand {
        self.demand
    }
    /// Records the tokens the request actually used (settlement).
    pub fn settle(&mut self, used_tokens: u64) {
        self.used_tokens = Some(used_tokens);
    }

    /// The answer reported `reported` cached prompt tokens, of a prompt of
    /// `prompt_tokens` the governor estimated `estimated` of.
    pub(crate) fn answered_cached(&self, estimated: u64, reported: u64, prompt_tokens: u64) {
        self.gov
            .prefix
            .answered(&self.tenant, estimated, reported, prompt_tokens);
    }

    /// Gives the latency guard what the proxy timed of this request (from
    /// its upstream send): TTFT and mean inter-token gap of a stream, or
    /// the whole time of a non-streaming answer, in ms.
    pub fn record_latency(&self, ttft_ms: Option<f64>, itl_ms: Option<f64>, e2e_ms: Option<f64>) {
        self.gov.record_latency(Sample {
            admitted_ms: self.admitted_ms,
            done_ms: self.gov.now_ms(),
            ttft_ms,
            itl_ms,
            e2e_ms,
        });
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let service_ms = self.admitted_at.elapsed().as_millis() as u64;
        self.gov.release(
            &self.tenant,
            self.demand,
            &self.charges,
            service_ms,
            self.used_tokens,
        );
    }
}

impl Governor {
    pub fn new(settings: Settings) -> Arc<Governor> {
        let cap = full_capacity(&settings.limits);
        // The record holds about what the server's cache does, until the
        // server says how much that is.
        let settings_kv_tokens = settings.limits.max_kv_tokens_in_flight;
        let mut ledger = Ledger::new(cap, settings.shares(), settings.tenants.default_burst);
        ledger.set_min_burst_capacity(burst_floor(&settings));
        let inner = Inner {
            latency: latency_guard(&settings),
            buckets: vec![Demand::default(); settings.limits.buckets.len() + 1],
            bucket_gauges: vec![],
            ledger,
            queue: AdmissionQueue::new(
                settings.queue.max_queue_len,
                settings.queue.max_queue_tokens,
                settings.tenants.weights(),
            ),
            ladder: Ladder::new(settings.ladder.clone(), 0),
            drain: DrainEstimator::new(settings.drain_window_ms),
            requests_in_flight: 0,
        };
        let gov = Arc::new(Governor {
            inner: Mutex::new(inner),
            settings: RwLock::new(Arc::new(settings)),
            metrics: Metrics::new(),
            draining: AtomicBool::new(false),
            idle: Notify::new(),
            epoch: Instant::now(),
            last_upstream_kv_milli: AtomicU64::new(0),
            engine_waiting: AtomicU64::new(pod_load::WAITING_UNKNOWN),
            scrape: Mutex::new(()),
            upstream_errors: AtomicU64::new(0),
            upstream_errors_seen: AtomicU64::new(0),
            added_latency_us: Mutex::new(
                hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"),
            ),
            cut: watch::channel(false).0,
            prefix: PrefixCache::new(Record::blocks_for_tokens(settings_kv_tokens)),
        });
        gov.set_profile_label();
        {
            let mut g = gov.lock();
            g.bucket_gauges = bucket_gauges(&gov.metrics, &gov.settings());
            gov.publish(&g);
        }
        gov
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain counters behind; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_profile_label(&self) {
        self.metrics.profile_info.clear();
        self.metrics
            .profile_info
            .get_or_create(&crate::metrics::label(
                "profile_id",
                &self.settings().profile_id,
            ))
            .set(1);
    }

    /// Caps in force now (profile and overrides, tightened by the ladder).
    pub fn limits(&self) -> Limits {
        let s = self.settings();
        let level = self.lock().ladder.level();
        effective_limits(&s.limits, level, s.ladder.small_context_factor)
    }

    pub fn level(&self) -> Level {
        self.lock().ladder.level()
    }

    /// The caps in force: the ladder's on context, output and KV, the
    /// latency guard's share of the envelope.
    fn apply_caps(&self, g: &mut Inner) {
        let s = self.settings();
        let l = effective_limits(&s.limits, g.ladder.level(), s.ladder.small_context_factor);
        let units = (CAPACITY_UNITS as f64 * g.latency.fraction()).floor() as u64;
        let floor = (CAPACITY_UNITS as f64 * g.latency.floor()).ceil() as u64;
        g.ledger.set_capacity(Demand {
            capacity: units.max(floor),
            ..full_capacity(&l)
        });
    }

    /// Lets the latency guard climb back when traffic is too thin to judge
    /// (call it every second or so).
    pub fn tick_latency(self: &Arc<Self>) {
        let now_ms = self.now_ms();
        let wakes = {
            let mut g = self.lock();
            if g.latency.tick(now_ms).is_none() {
                return;
            }
            self.apply_caps(&mut g);
            let w = self.pump(&mut g);
            self.publish(&g);
            w
        };
        Self::wake(wakes);
    }

    /// A completed request's timings: the latency guard judges them and
    /// may move the share of the envelope admitted.
    fn record_latency(self: &Arc<Self>, sample: Sample) {
        let (changed, wakes) = {
            let mut g = self.lock();
            let changed = g.latency.record(sample);
            // Only a new share moves the caps: then the queue may admit
            // more and the gauges change.
            let w = if changed.is_some() {
                self.apply_caps(&mut g);
                let w = self.pump(&mut g);
                self.publish(&g);
                w
            } else {
                Vec::new()
            };
            (changed.map(|f| (f, g.latency.cause, g.latency.last)), w)
        };
        if let Some((f, cause, o)) = changed {
            tracing::warn!(
                share = format!("{f:.3}"),
                cause,
                samples = o.samples,
                ttft_p95_ms = ?o.ttft_p95_ms,
                itl_p95_ms = ?o.itl_p95_ms,
                "latency guard moved the admitted share of the envelope"
            );
        }
        Self::wake(wakes);
    }

    /// Sets the gauges from the bookkeeping.
    fn publish(&self, g: &Inner) {
        let m = &self.metrics;
        let used = g.ledger.used();
        let cap = g.ledger.capacity();
        m.in_flight_sequences.set(used.seqs as i64);
        m.in_flight_requests.set(g.requests_in_flight as i64);
        m.reserved_kv_tokens.set(used.kv_tokens as i64);
        m.kv_headroom_tokens.set(g.ledger.kv_headroom() as i64);
        m.kv_capacity_tokens.set(cap.kv_tokens as i64);
        m.max_concurrent_sequences.set(cap.seqs as i64);
        m.queued_requests.set(g.queue.len() as i64);
        m.queued_tokens.set(g.queue.queued_tokens() as i64);
        m.ladder_state.set(g.ladder.level() as i64);
        m.capacity_used
            .set(used.capacity as f64 / CAPACITY_UNITS as f64);
        m.capacity_limit
            .set(cap.capacity as f64 / CAPACITY_UNITS as f64);
        for (d, (seqs, used)) in g.buckets.iter().zip(&g.bucket_gauges) {
            seqs.set(d.seqs as i64);
            used.set(d.capacity as f64 / CAPACITY_UNITS as f64);
        }
    }

    /// A permit for a reservation just made; counts it in its buckets.
    fn permit(
        self: &Arc<Self>,
        g: &mut Inner,
        tenant: &str,
        demand: Demand,
        charges: Vec<BucketCharge>,
        queued_for: Duration,
    ) -> Permit {
        g.requests_in_flight += 1;
        for c in &charges {
            if let Some(b) = g.buckets.get_mut(c.bucket) {
                b.seqs += c.seqs;
                b.capacity += c.capacity;
            }
        }
        Permit {
            gov: self.clone(),
            tenant: tenant.to_string(),
            demand,
            charges,
            admitted_at: Instant::now(),
            admitted_ms: self.now_ms(),
            queued_for,
            used_tokens: None,
        }
    }

    /// Grants whatever fits now; the wake-ups are returned to be sent after
    /// the lock is released (a failed send drops a permit, which locks).
    fn pump(self: &Arc<Self>, g: &mut Inner) -> Vec<(Waker, Result<Permit, GovernError>)> {
        // Most releases find no one waiting: no clock read, no sweep.
        if g.queue.is_empty() {
            return Vec::new();
        }
        let Inner { ledger, queue, .. } = &mut *g;
        let p = queue.pump(|e| ledger.reserve(&e.tenant, e.demand));
        let now = Instant::now();
        let mut out = Vec::with_capacity(p.granted.len() + p.never_fit.len());
        for e in p.granted {
            let waited = now.saturating_duration_since(e.enqueued);
            let (tx, charges) = e.payload;
            let permit = self.permit(g, &e.tenant, e.demand, charges, waited);
            out.push((tx, Ok(permit)));
        }
        let now_ms = self.now_ms();
        for e in p.tightened {
            let err = Self::tightened_error(g, now_ms, e.class, e.demand);
            out.push((e.payload.0, Err(err)));
        }
        for e in p.never_fit {
            out.push((
                e.payload.0,
                Err(GovernError::NeverFits {
                    param: "max_tokens",
                    message: "the caps were lowered while this request waited; it no longer fits"
                        .into(),
                }),
            ));
        }
        out
    }

    fn wake(wakes: Vec<(Waker, Result<Permit, GovernError>)>) {
        for (tx, r) in wakes {
            // A waiter that has gone away: its permit drops here and releases.
            let _ = tx.send(r);
        }
    }

    /// Why caps are below the profile's now, for messages.
    fn tightened_cause(g: &Inner) -> String {
        let mut why = vec![];
        if g.ladder.level() != Level::Normal {
            why.push(format!(
                "ladder {} ({})",
                g.ladder.level().label(),
                g.ladder.cause
            ));
        }
        if g.latency.fraction() < 1.0 {
            why.push(format!(
                "latency guard at {:.0}% of the envelope ({})",
                100.0 * g.latency.fraction(),
                g.latency.cause
            ));
        }
        if why.is_empty() {
            "caps lowered".into()
        } else {
            why.join("; ")
        }
    }

    /// 429 for a request that fits the profile but not today's caps.
    pub fn tightened(self: &Arc<Self>, class: Class, demand: Demand) -> GovernError {
        let mut g = self.lock();
        Self::tightened_error(&mut g, self.now_ms(), class, demand)
    }

    fn tightened_error(g: &mut Inner, now_ms: u64, class: Class, demand: Demand) -> GovernError {
        let ra = Self::retry_after(g, now_ms, class, demand).max(2);
        Self::overloaded(
            OverloadReason::GuardTightened,
            ra,
            format!(
                "the live guard has lowered the caps for now ({}); this request fits the profile, retry after {ra} s",
                Self::tightened_cause(g)
            ),
        )
    }

    fn release(
        self: &Arc<Self>,
        tenant: &str,
        demand: Demand,
        charges: &[BucketCharge],
        service_ms: u64,
        used: Option<u64>,
    ) {
        self.metrics
            .reserved_tokens_settled
            .inc_by(demand.kv_tokens);
        if let Some(u) = used {
            self.metrics.used_tokens_settled.inc_by(u);
        }
        let now_ms = self.now_ms();
        let wakes = {
            let mut g = self.lock();
            g.ledger.release(tenant, demand);
            g.requests_in_flight = g.requests_in_flight.saturating_sub(1);
            for c in charges {
                if let Some(b) = g.buckets.get_mut(c.bucket) {
                    b.seqs = b.seqs.saturating_sub(c.seqs);
                    b.capacity = b.capacity.saturating_sub(c.capacity);
                }
            }
            g.drain.record(now_ms, demand.kv_tokens, service_ms);
            let w = self.pump(&mut g);
            self.publish(&g);
            if g.requests_in_flight == 0 {
                self.idle.notify_waiters();
            }
            w
        };
        Self::wake(wakes);
    }

    /// Estimated wait before `demand` of `class` fits, in ms, behind what
    /// is queued ahead of it ([`wait_estimate::wait_ms`]).
    fn wait_estimate_ms(g: &mut Inner, now_ms: u64, class: Class, demand: Demand) -> Option<f64> {
        let ahead = g.queue.demand_ahead_of(class).plus(demand);
        wait_estimate::wait_ms(&g.ledger, ahead, &mut g.drain, now_ms)
    }

    /// Whole seconds (1..=60) until `demand` would likely fit.
    fn retry_after(g: &mut Inner, now_ms: u64, class: Class, demand: Demand) -> u64 {
        let ahead = g.queue.demand_ahead_of(class).plus(demand);
        wait_estimate::retry_after_s(&g.ledger, ahead, &mut g.drain, now_ms)
    }

    fn overloaded(reason: OverloadReason, retry_after_s: u64, message: String) -> GovernError {
        GovernError::Overloaded {
            reason,
            retry_after_s,
            message,
        }
    }

    /// 429 while the live guard refuses new work (REJECT_NEW).
    fn reject_new_error(g: &mut Inner, now_ms: u64, demand: Demand) -> GovernError {
        let ra = Self::retry_after(g, now_ms, Class::Batch, demand).max(2);
        Self::overloaded(
            OverloadReason::GuardRejectNew,
            ra,
            format!(
                "the upstream is under pressure ({}); retry later",
                g.ladder.cause
            ),
        )
    }

    /// The checks that cost nothing, made before a request's body is
    /// counted: draining, the guard refusing new work, a full queue.
    ///
    /// # Errors
    /// 503 while draining; 429 with a Retry-After otherwise.
    pub fn precheck(self: &Arc<Self>) -> Result<(), GovernError> {
        if self.is_draining() {
            return Err(GovernError::Draining);
        }
        let s = self.settings();
        let now_ms = self.now_ms();
        let mut g = self.lock();
        let one = Demand {
            seqs: 1,
            kv_tokens: 1,
            capacity: 1,
        };
        if g.ladder.level() == Level::RejectNew {
            return Err(Self::reject_new_error(&mut g, now_ms, one));
        }
        if !g.queue.is_empty() && g.queue.len() >= s.queue.max_queue_len {
            let ra = Self::retry_after(&mut g, now_ms, Class::Batch, one);
            return Err(Self::overloaded(
                OverloadReason::QueueFull,
                ra,
                format!(
                    "the admission queue is full ({} requests); retry after {ra} s",
                    g.queue.len()
                ),
            ));
        }
        Ok(())
    }

    /// 400 for a request that could not run even on an idle server.
    fn never_fits_error(g: &Inner, ask: &Ask) -> GovernError {
        let cap = g.ledger.full_capacity();
        GovernError::NeverFits {
            param: if ask.demand.seqs > cap.seqs { "n" } else { "max_tokens" },
            message: format!(
                "this request needs {} sequences and {} KV tokens; the most this server admits for tenant `{}` is {} sequences and {} KV tokens, so it can never run: lower max_tokens, n or the prompt",
                ask.demand.seqs, ask.demand.kv_tokens, ask.tenant, cap.seqs, cap.kv_tokens
            ),
        }
    }

    /// What admission knows of `ask` now, for [`decide`]: the wait is
    /// estimated only for a request that cannot start at once.
    fn snapshot(&self, g: &mut Inner, now_ms: u64, ask: &Ask) -> Snapshot {
        let fit = g.ledger.check(&ask.tenant, ask.demand);
        let queued = !g.queue.is_empty();
        let starts_now = fit.is_ok() && !queued;
        Snapshot {
            draining: self.draining.load(Ordering::Acquire),
            reject_new: g.ladder.level() == Level::RejectNew,
            fit,
            queued,
            wait_ms: if starts_now {
                None
            } else {
                Self::wait_estimate_ms(g, now_ms, ask.class, ask.demand)
            },
            service_ms: g.drain.service_ms(),
            recent_ttft_p95_ms: if starts_now {
                None
            } else {
                g.latency.recent_ttft_p95_ms(now_ms)
            },
        }
    }

    /// The error a refusal at arrival answers with.
    fn shed_error(g: &mut Inner, now_ms: u64, ask: &Ask, shed: Shed) -> GovernError {
        match shed {
            Shed::Draining => GovernError::Draining,
            Shed::RejectNew => Self::reject_new_error(g, now_ms, ask.demand),
            Shed::NeverFits => Self::never_fits_error(g, ask),
            Shed::Tightened => Self::tightened_error(g, now_ms, ask.class, ask.demand),
            Shed::DeadlineUnmeetable {
                wait_ms,
                service_ms,
                left_ms,
            } => Self::overloaded(
                OverloadReason::DeadlineUnmeetable,
                retry_after_from_ms(wait_ms),
                format!(
                    "estimated wait {wait_ms:.0} ms + service {service_ms:.0} ms exceeds the deadline of {left_ms:.0} ms"
                ),
            ),
            Shed::TtftBudget {
                wait_ms,
                ttft_ms,
                budget_ms,
            } => Self::overloaded(
                OverloadReason::TtftBudget,
                retry_after_from_ms(wait_ms),
                format!(
                    "estimated queue wait {wait_ms:.0} ms + the bucket's TTFT {ttft_ms:.0} ms exceeds the TTFT budget of {budget_ms:.0} ms"
                ),
            ),
        }
    }

    /// Admits now, queues until it fits, or refuses: [`decide`] on a
    /// snapshot taken under the lock, then acted on.
    ///
    /// # Errors
    /// 503 while draining; 400 if it can never fit; 429 with a Retry-After
    /// when the guard rejects new work, the queue is full, the deadline
    /// cannot be met, or the wait ran out.
    pub async fn admit(self: &Arc<Self>, ask: Ask) -> Result<Permit, GovernError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(GovernError::Draining);
        }
        let s = self.settings();
        let now = Instant::now();
        let now_ms = self.now_ms();
        let terms = Terms {
            left_ms: ask.deadline.saturating_duration_since(now).as_millis() as f64,
            max_queue_age_ms: s.queue.max_queue_age_ms as f64,
            ttft_budget_ms: match s.over_budget {
                OverBudget::Shed => {
                    ttft_budget_ms(s.ttft_budget_ms(ask.class), ask.ttft_objective_ms)
                }
                OverBudget::Queue => None,
            },
            expected_ttft_ms: ask.expected_ttft_ms,
        };
        let (id, rx, wait_until, bound, wakes) = {
            let mut g = self.lock();
            let snapshot = self.snapshot(&mut g, now_ms, &ask);
            let (max_wait_ms, bound) = match decide(&snapshot, &terms) {
                Decision::AdmitNow => {
                    // Checked by the snapshot, under the same lock.
                    g.ledger.commit(&ask.tenant, ask.demand);
                    let p =
                        self.permit(&mut g, &ask.tenant, ask.demand, ask.charges, Duration::ZERO);
                    self.publish(&g);
                    return Ok(p);
                }
                Decision::Shed(shed) => return Err(Self::shed_error(&mut g, now_ms, &ask, shed)),
                Decision::Queue { max_wait_ms, bound } => (max_wait_ms, bound),
            };
            let wait_until = match bound {
                QueueBound::Deadline => ask.deadline,
                QueueBound::QueueAge | QueueBound::TtftBudget => {
                    now + Duration::from_millis(max_wait_ms as u64)
                }
            };
            let (tx, rx) = oneshot::channel();
            match g.queue.push(
                &ask.tenant,
                ask.class,
                wait_until,
                now,
                ask.demand,
                (tx, ask.charges.clone()),
            ) {
                Ok(id) => {
                    // The head may be blocked only by its own tenant's
                    // ceiling; this one may fit now.
                    let w = self.pump(&mut g);
                    self.publish(&g);
                    (id, rx, wait_until, bound, w)
                }
                Err((why, _)) => {
                    let ra = Self::retry_after(&mut g, now_ms, ask.class, ask.demand);
                    return Err(Self::overloaded(
                        OverloadReason::QueueFull,
                        ra,
                        format!("the admission queue is full ({why:?}); retry after {ra} s"),
                    ));
                }
            }
        };
        Self::wake(wakes);
        // Boxed: see `queued`.
        Box::pin(self.wait_queued(id, rx, wait_until, bound, &ask, now)).await
    }
}

mod decide;
mod lifecycle;
mod now;
mod pod_load;
mod queued;
mod state;
mod wait_estimate;
