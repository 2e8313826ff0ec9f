//! Load generation over a [`Driver`] (the in-process engine, or an
//! OpenAI-compatible server over HTTP): closed loop (`concurrency` workers,
//! each sending its next request as soon as the last one ends) and open loop
//! (Poisson arrivals at a fixed rate, whatever the server's speed). A monitor
//! thread samples the server's KV use and memory meanwhile.

use crate::config::{Bucket, Prompts};
use crate::record::{Driver, LoadRequest, PrefixCache, RequestRecord};
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Fits `tokens` to exactly `n`: cut, or repeated from the start.
pub fn fit_tokens(tokens: &[u32], n: usize) -> Vec<u32> {
    if tokens.is_empty() {
        return vec![];
    }
    tokens.iter().copied().cycle().take(n).collect()
}

#[derive(Debug, Clone, Default)]
pub struct ProbeRun {
    pub records: Vec<RequestRecord>,
    pub duration_s: f64,
    pub kv_usage_max: Option<f64>,
    pub preemptions: Option<u64>,
    /// Growth of the server's prefix-cache counters over the probe, where
    /// it exports them.
    pub prefix_cache: Option<PrefixCache>,
    pub peak_memory_bytes: Option<u64>,
    /// Most requests in flight at once.
    pub max_in_flight: u32,
    /// Closed loop: longest gap between a worker's request ending and its next submission.
    pub max_client_gap_s: f64,
    /// Open loop: the share of arrivals sent over `late_after_s` (or a fifth
    /// of the mean gap) behind their schedule.
    pub late_fraction: f64,
    /// Open loop: the arrival rate asked for.
    pub offered_rate_per_s: Option<f64>,
    /// KV use, memory and requests in flight over the probe.
    pub series: Vec<SeriesPoint>,
    /// The load generator's CPU use over the probe as a fraction of all
    /// cores (out-of-process targets only).
    pub client_cpu_fraction: Option<f64>,
}

pub use envelope_engine::util::synthetic_prompt;

impl ProbeRun {
    /// This run followed by `more` at the same level (a probe extended
    /// until its verdict is decided): `more`'s times are shifted to follow
    /// on, counts add up, peaks take the higher, shares are weighted.
    pub fn extended(mut self, more: ProbeRun) -> ProbeRun {
        let offset = self.duration_s;
        let (n0, n1) = (self.records.len() as f64, more.records.len() as f64);
        let (d0, d1) = (self.duration_s, more.duration_s);
        self.records.extend(more.records.into_iter().map(|mut r| {
            r.start_s += offset;
            r
        }));
        self.series.extend(more.series.into_iter().map(|mut p| {
            p.t_s += offset;
            p
        }));
        self.duration_s = d0 + d1;
        self.kv_usage_max = max_opt(self.kv_usage_max, more.kv_usage_max);
        self.preemptions = match (self.preemptions, more.preemptions) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.prefix_cache = match (self.prefix_cache, more.prefix_cache) {
            (Some(a), Some(b)) => Some(PrefixCache {
                queries: a.queries + b.queries,
                hits: a.hits + b.hits,
            }),
            (a, b) => a.or(b),
        };
        self.peak_memory_bytes = max_opt(self.peak_memory_bytes, more.peak_memory_bytes);
        self.max_in_flight = self.max_in_flight.max(more.max_in_flight);
        self.max_client_gap_s = self.max_client_gap_s.max(more.max_client_gap_s);
        self.late_fraction =
            (self.late_fraction * n0 + more.late_fraction * n1) / (n0 + n1).max(1.0);
        self.client_cpu_fraction = match (self.client_cpu_fraction, more.client_cpu_fraction) {
            (Some(a), Some(b)) => Some((a * d0 + b * d1) / (d0 + d1).max(1e-9)),
            (a, b) => a.or(b),
        };
        self
    }
}

/// Ends a probe early: called with every record so far each time a
/// request ends; once it says true, no new request is sent (those in
/// flight finish). The sweep stops a probe whose verdict is decided.
pub type StopWhen = Arc<dyn Fn(&[RequestRecord]) -> bool + Send + Sync>;

/// The records of a probe as they end, and whether to send more.
struct Collected {
    records: Mutex<Vec<RequestRecord>>,
    stopped: AtomicBool,
    stop_when: Option<StopWhen>,
}

impl Collected {
    fn new(stop_when: Option<StopWhen>) -> Arc<Collected> {
        Arc::new(Collected {
            records: Mutex::new(vec![]),
            stopped: AtomicBool::new(false),
            stop_when,
        })
    }

    fn push(&self, rec: RequestRecord) {
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        records.push(rec);
        if let Some(f) = &self.stop_when {
            if !self.stopped.load(Ordering::Relaxed) && f(&records) {
                self.stopped.store(true, Ordering::Relaxed);
            }
        }
    }

    fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    fn take(&self) -> Vec<RequestRecord> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// One reading of the monitor's time series (`telemetry.csv`).
#[derive(Debug, Clone, Copy, Default)]
pub struct SeriesPoint {
    /// Seconds from the probe start.
    pub t_s: f64,
    pub kv_usage: Option<f64>,
    pub memory_bytes: Option<u64>,
    pub in_flight: u32,
}

/// The series keeps one reading per this interval; peaks use every reading.
const SERIES_EVERY: Duration = Duration::from_millis(100);

type MonitorResult = (Option<f64>, Option<u64>, Vec<SeriesPoint>);

/// Watches the driver until dropped into [`Monitor::finish`].
struct Monitor {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<MonitorResult>,
    preemptions_before: Option<u64>,
    prefix_cache_before: Option<PrefixCache>,
}

impl Monitor {
    fn start(driver: &Arc<dyn Driver>, in_flight: &Arc<InFlight>, start: Instant) -> Monitor {
        let before = driver.snapshot();
        let (preemptions_before, prefix_cache_before) =
            (before.preemptions_total, before.prefix_cache);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (d, stop, in_flight) = (driver.clone(), stop.clone(), in_flight.clone());
            std::thread::spawn(move || {
                let (mut kv, mut mem, mut series) = (None::<f64>, None::<u64>, vec![]);
                let mut next_point = start;
                let interval = d.monitor_interval();
                loop {
                    let s = d.snapshot();
                    kv = max_opt(kv, s.kv_usage);
                    mem = max_opt(mem, s.memory_bytes);
                    let now = Instant::now();
                    if now >= next_point {
                        series.push(SeriesPoint {
                            t_s: now.duration_since(start).as_secs_f64(),
                            kv_usage: s.kv_usage,
                            memory_bytes: s.memory_bytes,
                            in_flight: in_flight.now.load(Ordering::Relaxed),
                        });
                        next_point = now + SERIES_EVERY;
                    }
                    if stop.load(Ordering::Relaxed) {
                        return (kv, mem, series);
                    }
                    std::thread::sleep(interval);
                }
            })
        };
        Monitor {
            stop,
            thread,
            preemptions_before,
            prefix_cache_before,
        }
    }

    fn finish(self, driver: &dyn Driver, run: &mut ProbeRun) {
        self.stop.store(true, Ordering::Relaxed);
        let (kv, mem, series) = self.thread.join().unwrap_or_default();
        run.kv_usage_max = kv;
        run.peak_memory_bytes = mem;
        run.series = series;
        let after = driver.snapshot();
        run.preemptions = match (self.preemptions_before, after.preemptions_total) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        run.prefix_cache = match (self.prefix_cache_before, after.prefix_cache) {
            (Some(a), Some(b)) => Some(PrefixCache {
                queries: (b.queries - a.queries).max(0.0),
                hits: (b.hits - a.hits).max(0.0),
            }),
            _ => None,
        };
    }
}

fn max_opt<T: PartialOrd + Copy>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(x), Some(y)) => Some(if y > x { y } else { x }),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Counts requests in flight and remembers the most.
#[derive(Default)]
struct InFlight {
    now: AtomicU32,
    max: AtomicU32,
}

impl InFlight {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.max.fetch_max(n, Ordering::Relaxed);
    }
    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A warm bucket's shared prefix: the same tokens for every probe of the
/// bucket (so that a prefix cache holds them from one probe to the next),
/// different from other buckets' and from any probe's own tokens.
pub fn shared_prefix(bucket: Bucket, vocab: usize) -> Vec<u32> {
    const PREFIX_SALT: u64 = 0x5eed_0000;
    let salt =
        PREFIX_SALT + u64::from(bucket.input_tokens) * 100 + u64::from(bucket.cached_percent);
    synthetic_prompt(bucket.prefix_tokens() as usize, vocab, salt)
}

/// Before a warm bucket's probe: one request of the shared prefix alone
/// (one token out), so that a server with a prefix cache holds it when the
/// probe starts; sent before the monitor reads the server's counters, and
/// not recorded. Nothing for a cold bucket.
fn prime(driver: &dyn Driver, bucket: Bucket) {
    if bucket.cached_percent == 0 {
        return;
    }
    let req = LoadRequest {
        prompt_tokens: shared_prefix(bucket, driver.vocab_size()),
        prompt_text: None,
        output_tokens: 1,
    };
    let mut rec = RequestRecord::default();
    driver.send(&req, Instant::now(), &mut rec);
}

fn request(
    driver: &dyn Driver,
    prompts: &Prompts,
    bucket: Bucket,
    n: u64,
    salt: u64,
) -> LoadRequest {
    let input = bucket.input_tokens as usize;
    // A warm bucket: the shared prefix, then the request's own tokens.
    let synthetic = || {
        let own = input - bucket.prefix_tokens() as usize;
        let mut tokens = shared_prefix(bucket, driver.vocab_size());
        tokens.extend(synthetic_prompt(
            own,
            driver.vocab_size(),
            salt.wrapping_add(n),
        ));
        tokens
    };
    let (prompt_tokens, prompt_text) = match prompts {
        Prompts::Synthetic => (synthetic(), None),
        Prompts::Dataset(texts) => {
            let text = &texts[(n as usize) % texts.len()];
            match driver.tokenize(text) {
                // Real text, fitted to the bucket's exact input length.
                Some(t) if !t.is_empty() => (fit_tokens(&t, input), None),
                Some(_) => (synthetic(), None),
                None => (vec![], Some(text.clone())),
            }
        }
    };
    LoadRequest {
        prompt_tokens,
        prompt_text,
        output_tokens: bucket.output_tokens,
    }
}

/// Sends one request and times it end to end.
fn timed(
    driver: &dyn Driver,
    req: &LoadRequest,
    worker: u32,
    probe_start: Instant,
    in_flight: &InFlight,
) -> RequestRecord {
    let t0 = Instant::now();
    let mut rec = RequestRecord {
        worker,
        start_s: t0.duration_since(probe_start).as_secs_f64(),
        input_tokens: req.prompt_tokens.len() as u32,
        ..Default::default()
    };
    in_flight.enter();
    driver.send(req, t0, &mut rec);
    in_flight.leave();
    rec.e2e_s = t0.elapsed().as_secs_f64();
    if let Some(e) = crate::truth::judge(req.output_tokens, &rec, driver.exact_output()) {
        rec.error = Some(e);
    }
    rec
}

fn finish(
    mut records: Vec<RequestRecord>,
    start: Instant,
    in_flight: &InFlight,
    cpu_before: Option<f64>,
) -> ProbeRun {
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    let duration_s = start.elapsed().as_secs_f64();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    ProbeRun {
        records,
        duration_s,
        max_in_flight: in_flight.max.load(Ordering::Relaxed),
        client_cpu_fraction: cpu_before
            .zip(envelope_telemetry::host::process_cpu_seconds())
            .map(|(a, b)| (b - a) / (duration_s.max(1e-9) * cores)),
        ..Default::default()
    }
}

/// CPU seconds used so far, when the load generator's use can be told apart.
fn client_cpu(driver: &dyn Driver) -> Option<f64> {
    if driver.in_process() {
        None
    } else {
        envelope_telemetry::host::process_cpu_seconds()
    }
}

/// The longest Retry-After a closed-loop worker waits (the OpenAI clients
/// honour up to 60 s; a probe is shorter).
const MAX_RETRY_AFTER_S: f64 = 10.0;

/// A closed loop's workers: how many, and over how long their starts are
/// spread (worker `w` of `count` starts `w / count` of `ramp` in; zero:
/// all together, a burst).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Workers {
    pub count: u32,
    pub ramp: Duration,
}

impl Workers {
    /// When the last worker starts, from the probe's start: requests sent
    /// before it are the warm-up.
    pub fn level_reached(&self) -> Duration {
        self.start_of(self.count.saturating_sub(1))
    }

    fn start_of(&self, worker: u32) -> Duration {
        self.ramp
            .mul_f64(f64::from(worker) / f64::from(self.count.max(1)))
    }
}

impl From<u32> for Workers {
    /// Workers that all start together.
    fn from(count: u32) -> Workers {
        Workers {
            count,
            ramp: Duration::ZERO,
        }
    }
}

/// `workers` send `total_requests` between them, or fewer once
/// `stop_when` says so; a worker refused with Retry-After waits that long
/// first. Requests sent before the last worker starts are marked
/// `warmup`.
pub fn closed_loop(
    driver: &Arc<dyn Driver>,
    prompts: &Prompts,
    bucket: Bucket,
    workers: impl Into<Workers>,
    total_requests: u32,
    salt: u64,
    stop_when: Option<StopWhen>,
) -> ProbeRun {
    let shape: Workers = workers.into();
    let concurrency = shape.count;
    let reached_s = shape.level_reached().as_secs_f64();
    let collected = Collected::new(stop_when);
    let issued = Arc::new(AtomicU64::new(0));
    let gap = Arc::new(Mutex::new(0f64));
    let in_flight = Arc::new(InFlight::default());
    let barrier = Arc::new(std::sync::Barrier::new(concurrency as usize + 1));
    prime(&**driver, bucket);
    let cpu_before = client_cpu(&**driver);
    let start = Instant::now();
    let monitor = Monitor::start(driver, &in_flight, start);
    let workers: Vec<_> = (0..concurrency)
        .map(|w| {
            let (d, prompts, issued, gap, in_flight, barrier, collected) = (
                driver.clone(),
                prompts.clone(),
                issued.clone(),
                gap.clone(),
                in_flight.clone(),
                barrier.clone(),
                collected.clone(),
            );
            std::thread::spawn(move || {
                let mut last_end: Option<Instant> = None;
                barrier.wait();
                // The ramp: this worker's start, from the probe's.
                let wait = (start + shape.start_of(w)).saturating_duration_since(Instant::now());
                std::thread::sleep(wait);
                loop {
                    if collected.stopped() {
                        return;
                    }
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= total_requests as u64 {
                        return;
                    }
                    let req = request(&*d, &prompts, bucket, n, salt);
                    if let Some(e) = last_end {
                        let g = e.elapsed().as_secs_f64();
                        let mut m = gap.lock().unwrap_or_else(|e| e.into_inner());
                        *m = m.max(g);
                    }
                    let mut rec = timed(&*d, &req, w, start, &in_flight);
                    rec.warmup = rec.start_s < reached_s;
                    // A refusal's Retry-After is honoured, as a client of a
                    // governor does; the wait is not a client gap.
                    if let Some(s) = rec.retry_after_s {
                        std::thread::sleep(Duration::from_secs_f64(s.min(MAX_RETRY_AFTER_S)));
                    }
                    collected.push(rec);
                    last_end = Some(Instant::now());
                }
            })
        })
        .collect();
    barrier.wait();
    for w in workers {
        let _ = w.join();
    }
    let mut run = finish(collected.take(), start, &in_flight, cpu_before);
    run.max_client_gap_s = *gap.lock().unwrap_or_else(|e| e.into_inner());
    monitor.finish(&**driver, &mut run);
    run
}

/// The arrivals of an open-loop probe.
#[derive(Debug, Clone, Copy)]
pub struct Arrivals {
    pub rate_per_s: f64,
    pub total_requests: u32,
    /// An arrival sent over this long (or a fifth of the mean gap) behind
    /// its schedule is late.
    pub late_after_s: f64,
    /// Seeds the gaps.
    pub salt: u64,
}

/// Poisson arrivals at `rate_per_s` (exponential gaps from a seeded
/// generator) until `total_requests` are sent, or fewer once `stop_when`
/// says so; each request runs on its own thread, so a slow server does not
/// slow the arrivals.
pub fn open_loop(
    driver: &Arc<dyn Driver>,
    prompts: &Prompts,
    bucket: Bucket,
    arrivals: Arrivals,
    stop_when: Option<StopWhen>,
) -> ProbeRun {
    let Arrivals {
        rate_per_s,
        total_requests,
        late_after_s,
        salt,
    } = arrivals;
    let collected = Collected::new(stop_when);
    let mut rng = rand::rngs::StdRng::seed_from_u64(salt);
    let in_flight = Arc::new(InFlight::default());
    let mean_gap_s = 1.0 / rate_per_s.max(1e-9);
    let late_after_s = (0.2 * mean_gap_s).max(late_after_s);
    prime(&**driver, bucket);
    let cpu_before = client_cpu(&**driver);
    let start = Instant::now();
    let monitor = Monitor::start(driver, &in_flight, start);
    let (mut due_s, mut late, mut threads, mut sent) = (0f64, 0u32, vec![], 0u32);
    for n in 0..total_requests {
        if collected.stopped() {
            break;
        }
        // Inverse-CDF sample of an exponential gap; 1 - u is in (0, 1].
        let u: f64 = rng.random();
        due_s += -(1.0 - u).ln() * mean_gap_s;
        let now_s = start.elapsed().as_secs_f64();
        if due_s > now_s {
            std::thread::sleep(Duration::from_secs_f64(due_s - now_s));
        } else if now_s - due_s > late_after_s {
            late += 1;
        }
        let req = request(&**driver, prompts, bucket, n as u64, salt);
        let (d, in_flight, collected) = (driver.clone(), in_flight.clone(), collected.clone());
        threads.push(std::thread::spawn(move || {
            collected.push(timed(&*d, &req, n, start, &in_flight))
        }));
        sent += 1;
    }
    for t in threads {
        let _ = t.join();
    }
    let mut run = finish(collected.take(), start, &in_flight, cpu_before);
    run.late_fraction = late as f64 / sent.max(1) as f64;
    run.offered_rate_per_s = Some(rate_per_s);
    monitor.finish(&**driver, &mut run);
    run
}

/// One call of a scheduled session.
#[derive(Debug, Clone)]
pub struct ScheduledCall {
    /// Seconds into the probe it is due; a call after the first of its
    /// session is sent at the later of this and its predecessor's end.
    pub due_s: f64,
    pub class: Option<String>,
    pub tenant: Option<String>,
    pub request: LoadRequest,
}

/// Sessions on a schedule: each starts at its first call's due time on a
/// thread of its own and sends its calls one after another (a call waits
/// for the previous answer, as an agent does), each at the later of its
/// due time and its predecessor's end. A call sent over `late_after_s`
/// behind that is late; the run's `late_fraction` is over calls. Once
/// `stop_when` says so, no call is sent (those in flight finish).
pub fn open_schedule(
    driver: &Arc<dyn Driver>,
    mut sessions: Vec<Vec<ScheduledCall>>,
    late_after_s: f64,
    stop_when: Option<StopWhen>,
) -> ProbeRun {
    sessions.retain(|s| !s.is_empty());
    sessions.sort_by(|a, b| a[0].due_s.total_cmp(&b[0].due_s));
    let collected = Collected::new(stop_when);
    let in_flight = Arc::new(InFlight::default());
    let (late, sent) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let cpu_before = client_cpu(&**driver);
    let start = Instant::now();
    let monitor = Monitor::start(driver, &in_flight, start);
    let mut threads = vec![];
    for (i, calls) in sessions.into_iter().enumerate() {
        if collected.stopped() {
            break;
        }
        let now_s = start.elapsed().as_secs_f64();
        if calls[0].due_s > now_s {
            std::thread::sleep(Duration::from_secs_f64(calls[0].due_s - now_s));
        }
        let (d, in_flight, collected) = (driver.clone(), in_flight.clone(), collected.clone());
        let (late, sent) = (late.clone(), sent.clone());
        threads.push(std::thread::spawn(move || {
            let mut free_s = 0f64;
            for call in calls {
                if collected.stopped() {
                    return;
                }
                let due_s = call.due_s.max(free_s);
                let now_s = start.elapsed().as_secs_f64();
                if due_s > now_s {
                    std::thread::sleep(Duration::from_secs_f64(due_s - now_s));
                } else if now_s - due_s > late_after_s {
                    late.fetch_add(1, Ordering::Relaxed);
                }
                sent.fetch_add(1, Ordering::Relaxed);
                let mut r = timed(&*d, &call.request, i as u32, start, &in_flight);
                r.class = call.class;
                r.tenant = call.tenant;
                r.run = i as u32;
                free_s = r.start_s + r.e2e_s;
                collected.push(r);
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    let mut run = finish(collected.take(), start, &in_flight, cpu_before);
    run.late_fraction =
        late.load(Ordering::Relaxed) as f64 / sent.load(Ordering::Relaxed).max(1) as f64;
    monitor.finish(&**driver, &mut run);
    run
}

#[cfg(test)]
mod tests;
