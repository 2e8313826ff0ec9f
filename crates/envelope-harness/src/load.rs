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
mod tests {
    use super::*;
    use crate::record::Snapshot;

    #[test]
    fn datasets_read_lines_and_json_lines_and_name_bad_lines() {
        let dir = std::env::temp_dir().join(format!("envelope-prompts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("p.jsonl");
        std::fs::write(
            &f,
            "plain prompt\n\n{\"prompt\": \"json prompt\"}\n{\"text\": \"t\"}\n",
        )
        .unwrap();
        match Prompts::from_file(&f).unwrap() {
            Prompts::Dataset(p) => assert_eq!(*p, vec!["plain prompt", "json prompt", "t"]),
            Prompts::Synthetic => panic!("a dataset"),
        }
        std::fs::write(&f, "ok\n{\"messages\": []}\n").unwrap();
        let e = Prompts::from_file(&f).unwrap_err();
        assert!(e.contains("p.jsonl:2") && e.contains("prompt"), "{e}");
        std::fs::write(&f, "\n\n").unwrap();
        assert!(Prompts::from_file(&f).unwrap_err().contains("no prompts"));
        assert!(Prompts::from_file(&dir.join("missing")).is_err());
    }

    /// Records what it is sent; tokenizes bytes when asked to.
    struct Recorder {
        tokenizes: bool,
        seen: Mutex<Vec<LoadRequest>>,
    }

    impl Driver for Recorder {
        fn vocab_size(&self) -> usize {
            1000
        }
        fn tokenize(&self, text: &str) -> Option<Vec<u32>> {
            self.tokenizes
                .then(|| text.bytes().map(u32::from).collect())
        }
        fn send(&self, req: &LoadRequest, _t0: Instant, rec: &mut RequestRecord) {
            rec.output_tokens = req.output_tokens;
            rec.finish_reason = Some("length".into());
            self.seen.lock().unwrap().push(req.clone());
        }
        fn snapshot(&self) -> Snapshot {
            Snapshot::default()
        }
    }

    #[test]
    fn a_warm_bucket_primes_its_prefix_and_every_prompt_shares_it() {
        let bucket = Bucket::parse("40x2@75%").unwrap();
        assert_eq!(bucket.prefix_tokens(), 30);
        let r = Arc::new(Recorder {
            tokenizes: false,
            seen: Mutex::new(vec![]),
        });
        let d: Arc<dyn Driver> = r.clone();
        let run = closed_loop(&d, &Prompts::Synthetic, bucket, 2, 6, 7, None);
        assert_eq!(run.records.len(), 6, "the priming request is not recorded");
        let seen = r.seen.lock().unwrap();
        // First the prefix alone, one token out; then the probe's six.
        assert_eq!(seen.len(), 7);
        let prefix = shared_prefix(bucket, 1000);
        assert_eq!(seen[0].prompt_tokens, prefix);
        assert_eq!(seen[0].output_tokens, 1);
        let probe = &seen[1..];
        assert!(probe.iter().all(|q| q.prompt_tokens.len() == 40));
        assert!(probe.iter().all(|q| q.prompt_tokens[..30] == prefix[..]));
        // Each keeps its own tail: no two prompts are the same.
        let tails: std::collections::HashSet<_> = probe
            .iter()
            .map(|q| q.prompt_tokens[30..].to_vec())
            .collect();
        assert_eq!(tails.len(), 6);
        drop(seen);
        // A probe with another salt shares the same prefix (it stays
        // cached from one probe to the next); another bucket does not.
        let again = closed_loop(&d, &Prompts::Synthetic, bucket, 1, 1, 99, None);
        assert_eq!(again.records.len(), 1);
        assert_eq!(
            r.seen.lock().unwrap().last().unwrap().prompt_tokens[..30],
            prefix[..]
        );
        let other = shared_prefix(Bucket::parse("40x2@50%").unwrap(), 1000);
        assert_ne!(other[..20], prefix[..20]);
        // A cold bucket sends no priming request, and its prompts share nothing.
        r.seen.lock().unwrap().clear();
        closed_loop(&d, &Prompts::Synthetic, Bucket::cold(40, 2), 2, 4, 7, None);
        let seen = r.seen.lock().unwrap();
        assert_eq!(seen.len(), 4);
        assert!(seen.iter().all(|q| q.output_tokens == 2));
        assert_ne!(seen[0].prompt_tokens[..8], seen[1].prompt_tokens[..8]);
    }

    #[test]
    fn dataset_prompts_reach_the_driver_as_tokens_or_as_text() {
        let data = Prompts::Dataset(Arc::new(vec!["ab".into(), "xyz".into()]));
        let bucket = Bucket::cold(5, 2);
        for tokenizes in [true, false] {
            let r = Arc::new(Recorder {
                tokenizes,
                seen: Mutex::new(vec![]),
            });
            let d: Arc<dyn Driver> = r.clone();
            let run = closed_loop(&d, &data, bucket, 2, 4, 0, None);
            assert_eq!(run.records.len(), 4);
            let mut seen = r.seen.lock().unwrap().clone();
            seen.sort_by_key(|q| (q.prompt_tokens.clone(), q.prompt_text.clone()));
            if tokenizes {
                // Each text twice, its bytes repeated to exactly 5 tokens.
                let ab: Vec<u32> = b"ababa".iter().map(|&b| b as u32).collect();
                let xyz: Vec<u32> = b"xyzxy".iter().map(|&b| b as u32).collect();
                let got: Vec<_> = seen.iter().map(|q| q.prompt_tokens.clone()).collect();
                assert_eq!(got, vec![ab.clone(), ab, xyz.clone(), xyz]);
            } else {
                let got: Vec<_> = seen
                    .iter()
                    .map(|q| q.prompt_text.clone().unwrap())
                    .collect();
                assert_eq!(got, vec!["ab", "ab", "xyz", "xyz"]);
                assert!(seen.iter().all(|q| q.prompt_tokens.is_empty()));
            }
        }
        // Synthetic prompts: exact length, no text.
        let r = Arc::new(Recorder {
            tokenizes: true,
            seen: Mutex::new(vec![]),
        });
        let d: Arc<dyn Driver> = r.clone();
        open_loop(&d, &Prompts::Synthetic, bucket, arrivals(200.0, 3), None);
        let seen = r.seen.lock().unwrap();
        assert_eq!(seen.len(), 3);
        assert!(seen
            .iter()
            .all(|q| q.prompt_tokens.len() == 5 && q.prompt_text.is_none()));
    }

    #[test]
    fn dataset_tokens_are_fitted_to_the_exact_length() {
        assert_eq!(fit_tokens(&[1, 2, 3], 7), vec![1, 2, 3, 1, 2, 3, 1]);
        assert_eq!(fit_tokens(&[1, 2, 3], 2), vec![1, 2]);
        assert!(fit_tokens(&[], 4).is_empty());
    }

    /// Answers each request after `ms` milliseconds.
    struct Slow(u64);

    impl Driver for Slow {
        fn vocab_size(&self) -> usize {
            1000
        }
        fn send(&self, req: &LoadRequest, _t0: Instant, rec: &mut RequestRecord) {
            std::thread::sleep(Duration::from_millis(self.0));
            rec.output_tokens = req.output_tokens;
            rec.finish_reason = Some("length".into());
        }
        fn snapshot(&self) -> Snapshot {
            Snapshot::default()
        }
    }

    #[test]
    fn ramped_workers_start_in_turn_and_their_first_requests_are_warm_up() {
        let bucket = Bucket::cold(5, 2);
        let d: Arc<dyn Driver> = Arc::new(Slow(200));
        let workers = Workers {
            count: 4,
            ramp: Duration::from_millis(200),
        };
        assert_eq!(workers.level_reached(), Duration::from_millis(150));
        let run = closed_loop(&d, &Prompts::Synthetic, bucket, workers, 12, 0, None);
        assert_eq!(run.records.len(), 12);
        // Each worker's first request: worker w no sooner than w x 50 ms.
        for w in 0..4u32 {
            let first = run
                .records
                .iter()
                .filter(|r| r.worker == w)
                .map(|r| r.start_s)
                .fold(f64::INFINITY, f64::min);
            assert!(first >= 0.05 * f64::from(w) - 1e-3, "worker {w} at {first}");
        }
        // Sent before the last worker started (150 ms): the first requests
        // of workers 0-2, and no other (each takes 200 ms).
        let warm: Vec<_> = run.records.iter().filter(|r| r.warmup).collect();
        assert_eq!(warm.len(), 3, "{:?}", run.records);
        assert!(warm.iter().all(|r| r.start_s < 0.15 && r.worker < 3));
        assert!(run
            .records
            .iter()
            .filter(|r| !r.warmup)
            .all(|r| r.start_s >= 0.15));
        // Started together (no ramp), nothing is warm-up.
        let burst = closed_loop(&d, &Prompts::Synthetic, bucket, 4, 8, 0, None);
        assert!(burst.records.iter().all(|r| !r.warmup));
    }

    fn arrivals(rate_per_s: f64, total_requests: u32) -> Arrivals {
        Arrivals {
            rate_per_s,
            total_requests,
            late_after_s: 0.010,
            salt: 1,
        }
    }

    #[test]
    fn a_probe_stops_sending_once_told_and_an_extension_follows_on() {
        let bucket = Bucket::cold(5, 2);
        let r = Arc::new(Recorder {
            tokenizes: false,
            seen: Mutex::new(vec![]),
        });
        let d: Arc<dyn Driver> = r.clone();
        // Stop after 10 answers: two workers send at most one more each
        // (the ones in flight), never the 100 asked.
        let stop: StopWhen = Arc::new(|records: &[RequestRecord]| records.len() >= 10);
        let run = closed_loop(
            &d,
            &Prompts::Synthetic,
            bucket,
            2,
            100,
            0,
            Some(stop.clone()),
        );
        assert!(
            (10..=11).contains(&run.records.len()),
            "{}",
            run.records.len()
        );
        let open = open_loop(
            &d,
            &Prompts::Synthetic,
            bucket,
            arrivals(1000.0, 100),
            Some(stop),
        );
        assert!(open.records.len() < 100, "{}", open.records.len());
        // Without a stop, every request asked for.
        let whole = closed_loop(&d, &Prompts::Synthetic, bucket, 2, 30, 0, None);
        assert_eq!(whole.records.len(), 30);
        // An extension's requests follow on in time, counts add up.
        let (d0, n0) = (run.duration_s, run.records.len());
        let mut later = whole.clone();
        later.preemptions = Some(2);
        later.max_in_flight = 7;
        let joined = run.extended(later);
        assert_eq!(joined.records.len(), n0 + 30);
        assert!((joined.duration_s - d0 - whole.duration_s).abs() < 1e-12);
        assert!(joined.records[n0..].iter().all(|r| r.start_s >= d0));
        assert_eq!((joined.preemptions, joined.max_in_flight), (Some(2), 7));
    }
}
