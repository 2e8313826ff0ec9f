//! The sweep: every matrix point, every bucket, a bracket search over
//! concurrency (closed loop) or arrival rate (Poisson); an OOM, a crash or a
//! failed load is recorded and the sweep goes on.

use crate::config::{BenchConfig, MatrixPoint};
use crate::load::{closed_loop, open_loop, Arrivals, ProbeRun, Workers};
use crate::record::RequestRecord;
use envelope_profile::{
    ConfigResult, Constraint, LevelSearch, LevelStep, LevelVerdict, Limits, MemoryReport,
    ProbeSummary, Profile, PROFILE_SCHEMA,
};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

pub struct SweepOutput {
    pub profile: Profile,
    /// Why `[quality]` gave no result, when it did not.
    pub quality_error: Option<String>,
    pub requests: Vec<RequestRow>,
    pub probes: Vec<ProbeRow>,
    pub telemetry: Vec<TelemetryRow>,
}

/// What the sweep tells its caller as it goes.
pub enum SweepEvent<'a> {
    /// A probe is about to run (config, bucket, what is probed).
    Probing(&'a str),
    /// A probe ended.
    Probed(&'a ProbeRow),
    /// Something the user should know about a configuration's server
    /// (it ignores `ignore_eos`, refuses token-id prompts, ...).
    Note(&'a str),
}

mod rows;
mod scaled;
mod session;
mod summary;
use rows::push_rows;
pub use rows::{ProbeRow, RequestRow, TelemetryRow};
use session::open;
pub use summary::{
    breaches, bucket_result, decision, knee, kv_tokens_limit, level_verdict, max_requests,
    merge_repeats, requests_to_decide, requests_to_hold, slo_checks, stop_when_decided, summarise,
};

/// Restarts of a launched server after crashes, per configuration.
const MAX_RESTARTS: u32 = 3;

struct Ctx<'a> {
    cfg: &'a BenchConfig,
    log_dir: &'a Path,
    /// The repeat of the whole search under way.
    repeat: u32,
    probes_total: u32,
    requests: Vec<RequestRow>,
    probes: Vec<ProbeRow>,
    telemetry: Vec<TelemetryRow>,
}

/// The levels a bucket's search runs over: concurrencies, or rates in
/// steps of `load.rate_step_per_s` in open loop.
fn level_range(cfg: &BenchConfig) -> (u32, u32) {
    if cfg.load.is_open_loop() {
        let step = cfg.load.rate_step_per_s;
        (
            (cfg.load.rate_min_per_s / step).ceil() as u32,
            ((cfg.load.rate_max_per_s / step).floor() as u32).max(1),
        )
    } else {
        (
            cfg.concurrency_min,
            cfg.concurrency_max.min(cfg.max_num_seqs),
        )
    }
}

/// The probes a sweep of `cfg` can be expected to run, from the level
/// search's own steps ([`envelope_profile::search::expected_probes`]) per
/// configuration, bucket and repeat: for a progress bar.
pub fn expected_probes(cfg: &BenchConfig) -> u64 {
    let (lo, hi) = level_range(cfg);
    let per_search = envelope_profile::search::expected_probes(lo, hi.max(lo));
    let searches = cfg.points.len() * cfg.buckets.len() * cfg.load.repeats.max(1) as usize;
    (per_search * searches as f64).ceil() as u64
}

fn run_point(
    ctx: &mut Ctx,
    point: &MatrixPoint,
    progress: &mut dyn FnMut(SweepEvent),
) -> ConfigResult {
    let cfg = ctx.cfg;
    let name = point.name();
    let mut result = ConfigResult {
        name: name.clone(),
        precision: point.precision.clone(),
        kv_dtype: point.kv_dtype.clone(),
        batch_policy: point.policy.clone(),
        max_num_seqs: cfg.max_num_seqs,
        memory: MemoryReport::default(),
        backend: None,
        buckets: vec![],
        error: None,
        server_checks: None,
        time_to_ready_s: None,
        workload: None,
        trace: None,
    };
    let mut attempt = 0;
    let mut session = match open(cfg, point, ctx.log_dir, attempt) {
        Ok(s) => s,
        Err(e) => {
            result.error = Some(e);
            return result;
        }
    };
    result.memory = session.memory.clone();
    result.backend = session.engine.as_ref().map(|e| e.info.backend.clone());
    result.server_checks = session.checks.clone();
    result.time_to_ready_s = session
        .server
        .as_ref()
        .map(|s| s.time_to_ready.as_secs_f64());
    for note in session.checks.iter().flat_map(|c| &c.notes) {
        progress(SweepEvent::Note(&format!("{name}: {note}")));
    }
    let open_loop_mode = cfg.load.is_open_loop();
    let (lo, hi) = level_range(cfg);
    'buckets: for bucket in &cfg.buckets {
        let bname = bucket.label();
        let mut search = LevelSearch::new(lo, hi.max(lo));
        // Per level searched: its summary (in the order first probed), and
        // its probe id and requests, which a decision extends.
        let mut probes: Vec<(u32, ProbeSummary)> = vec![];
        let mut runs: HashMap<u32, (u32, ProbeRun)> = HashMap::new();
        let budget = max_requests(&cfg.load, &cfg.slo, bucket.output_tokens);
        loop {
            let (k, extending) = match search.next() {
                LevelStep::Screen(k) => (k, false),
                LevelStep::Decide(k) => (k, true),
                LevelStep::Done => break,
            };
            let rate = k as f64 * cfg.load.rate_step_per_s;
            let level = if open_loop_mode {
                format!("{rate:.2} req/s")
            } else {
                format!("concurrency {k}")
            };
            // Closed loop: the workers ramp in over about one request time,
            // the median end-to-end latency of the nearest level below
            // (none for a bucket's first probe); what they send before the
            // last one starts is warm-up, on top of what the probe needs.
            let workers = Workers {
                count: k,
                ramp: if cfg.load.ramp && !open_loop_mode && k > 1 {
                    probes
                        .iter()
                        .filter(|(l, _)| *l < k)
                        .max_by_key(|(l, _)| *l)
                        .map_or(Duration::ZERO, |(_, p)| {
                            Duration::from_secs_f64(p.e2e_ms.p50.max(0.0) / 1e3)
                        })
                } else {
                    Duration::ZERO
                },
            };
            let warmup = if workers.ramp.is_zero() { 0 } else { k };
            let before = if extending { runs.remove(&k) } else { None };
            let done = before.as_ref().map_or(0, |(_, r)| r.records.len() as u32);
            let total = if extending {
                budget.saturating_sub(done)
            } else if open_loop_mode {
                ((rate * cfg.load.duration_s).round() as u32).max(cfg.load.min_requests)
            } else {
                (k * cfg.load.rounds).max(cfg.load.min_requests) + warmup
            };
            let what = if extending {
                format!("{name} {bname}: deciding {level} (up to {total} more requests)")
            } else {
                format!("{name} {bname}: probing {level}")
            };
            progress(SweepEvent::Probing(&what));
            let salt = ctx.probes_total as u64 * 1000;
            let prior = before
                .as_ref()
                .map(|(_, r)| r.records.clone())
                .unwrap_or_default();
            // One run of `n` requests at this level, stopped once decided.
            let run_at = |n: u32, salt: u64, before: Vec<RequestRecord>, at_least: usize| {
                let stop = Some(stop_when_decided(&cfg.slo, before, at_least));
                if open_loop_mode {
                    let arrivals = Arrivals {
                        rate_per_s: rate,
                        total_requests: n,
                        late_after_s: cfg.load.late_after_ms / 1e3,
                        salt,
                    };
                    open_loop(&session.driver, &cfg.prompts, *bucket, arrivals, stop)
                } else {
                    closed_loop(
                        &session.driver,
                        &cfg.prompts,
                        *bucket,
                        workers,
                        n,
                        salt,
                        stop,
                    )
                }
            };
            let run = if !extending {
                run_at(total, salt, vec![], total as usize)
            } else {
                // First the fewest requests that would decide the level if
                // none were over a limit (closed loop: whole waves of k, so
                // no request runs under less load than the level's); if that
                // did not decide it, on without a break until decided or
                // the budget is spent. (Every new run starts its workers
                // together, a burst the level's steady state does not see:
                // one restart, not one per chunk.)
                let mut new = ProbeRun::default();
                for chunk_no in 1u64..=2 {
                    let mut seen = prior.clone();
                    seen.extend(new.records.iter().cloned());
                    let left = total.saturating_sub(new.records.len() as u32);
                    let decided = stop_when_decided(&cfg.slo, vec![], 0)(&seen);
                    let need = requests_to_hold(&seen, &cfg.slo, bucket.output_tokens);
                    let chunk = match need {
                        Some(n) if n > 0 && left > 0 && !decided => {
                            let n = if open_loop_mode {
                                n
                            } else {
                                n.div_ceil(k) * k + warmup
                            };
                            if chunk_no == 1 {
                                n.min(left)
                            } else {
                                left
                            }
                        }
                        _ => break,
                    };
                    // Fresh prompts in every run (a prefix cache must not
                    // make the extension faster than the screen).
                    let r = run_at(chunk, salt ^ (chunk_no << 40), seen, 0);
                    new = if new.records.is_empty() {
                        r
                    } else {
                        new.extended(r)
                    };
                }
                new
            };
            let probe_id = ctx.probes_total;
            ctx.probes_total += 1;
            let requests_of_this_probe = run.clone();
            let extends = before.as_ref().map(|(id, _)| *id);
            let whole = match before {
                Some((_, r)) => r.extended(run),
                None => run,
            };
            let shown = if open_loop_mode {
                whole.max_in_flight
            } else {
                k
            };
            let mut s = summarise(&whole, shown, &cfg.slo, &cfg.load);
            let died = session.died();
            if let Some(c) = died {
                s.breaches.insert(0, c);
            }
            let verdict = level_verdict(&s, extending);
            if verdict == LevelVerdict::Undecided {
                s.breaches.insert(0, Constraint::Undecided);
            }
            search.record(k, verdict);
            push_rows(
                ctx,
                &name,
                &bname,
                (probe_id, extends),
                k,
                &requests_of_this_probe,
                &s,
            );
            progress(SweepEvent::Probed(ctx.probes.last().expect("just pushed")));
            result.memory.peak_bytes = result.memory.peak_bytes.max(s.peak_memory_bytes);
            // Every request of the configuration's first probe failed with the
            // server alive: a setup error (wrong model name, bad URL), not a
            // load limit.
            let all_failed = s.requests > 0 && s.errors == s.requests;
            let first_error = whole.records.iter().find_map(|r| r.error.clone());
            let setup_error =
                result.buckets.is_empty() && probes.is_empty() && all_failed && died.is_none();
            match probes.iter_mut().find(|(l, _)| *l == k) {
                Some(p) => p.1 = s,
                None => probes.push((k, s)),
            }
            runs.insert(k, (extends.unwrap_or(probe_id), whole));
            if setup_error {
                result.error = Some(format!(
                    "every request of the first probe failed: {}",
                    first_error.unwrap_or_default()
                ));
                result.buckets.push(bucket_result(
                    &cfg.load,
                    cfg.slo.headroom,
                    *bucket,
                    &search,
                    probes,
                ));
                break 'buckets;
            }
            if died.is_some() {
                // A crash is a data point: restart and search on below it.
                session.close();
                attempt += 1;
                let reopened = if attempt > MAX_RESTARTS {
                    Err(format!("the server died {attempt} times; giving up"))
                } else {
                    open(cfg, point, ctx.log_dir, attempt)
                };
                match reopened {
                    Ok(s) => session = s,
                    Err(e) => {
                        result.error = Some(format!("restart after a crash failed: {e}"));
                        result.buckets.push(bucket_result(
                            &cfg.load,
                            cfg.slo.headroom,
                            *bucket,
                            &search,
                            probes,
                        ));
                        return result;
                    }
                }
            }
        }
        result.buckets.push(bucket_result(
            &cfg.load,
            cfg.slo.headroom,
            *bucket,
            &search,
            probes,
        ));
        if result.error.is_some() {
            break 'buckets;
        }
    }
    if let (Some(a), None) = (&cfg.agents, &result.error) {
        result.workload = Some(scaled::search_scaled(ctx, &mut session, a, &name, progress));
    }
    if let (Some(t), None) = (&cfg.trace, &result.error) {
        result.trace = Some(scaled::search_scaled(ctx, &mut session, t, &name, progress));
    }
    session.close();
    result
}

/// `[quality]`: scores the selected configuration's precision.
fn score_quality(
    cfg: &BenchConfig,
    best: Option<&ConfigResult>,
) -> Result<Option<envelope_profile::QualityReport>, String> {
    let Some(q) = &cfg.quality else {
        return Ok(None);
    };
    let point = best
        .and_then(|b| cfg.points.iter().find(|p| p.name() == b.name))
        .and_then(|p| p.engine)
        .ok_or("quality: no configuration was selected to score")?;
    let opts = crate::quality::QualityOptions {
        window_tokens: q.window_tokens,
        max_windows: q.max_windows,
        kv_dtype: point.kv_dtype,
    };
    crate::quality::measure(
        &cfg.model,
        None,
        point.precision,
        q.reference,
        &q.text_set,
        &q.text,
        &opts,
    )
    .map(Some)
    .map_err(|e| format!("quality: {e}"))
}

/// Runs the whole sweep; launched servers' logs go to `log_dir`.
pub fn run_sweep(
    cfg: &BenchConfig,
    fingerprint: serde_json::Value,
    log_dir: &Path,
    progress: &mut dyn FnMut(SweepEvent),
) -> SweepOutput {
    let mut ctx = Ctx {
        cfg,
        log_dir,
        repeat: 0,
        probes_total: 0,
        requests: vec![],
        probes: vec![],
        telemetry: vec![],
    };
    // Every configuration once a repeat, in turn: drift over the run hits
    // all of them alike.
    let mut repeats: Vec<Vec<ConfigResult>> = vec![];
    for r in 0..cfg.load.repeats.max(1) {
        ctx.repeat = r;
        let run: Vec<ConfigResult> = cfg
            .points
            .iter()
            .map(|p| run_point(&mut ctx, p, progress))
            .collect();
        repeats.push(run);
    }
    let configs = merge_repeats(repeats);
    let mut fingerprint = fingerprint;
    record_served_model(&mut fingerprint, &configs);
    let probes_total = ctx.probes_total;
    let telemetry = ctx.telemetry;
    let rows = (ctx.requests, ctx.probes);
    // The limits come from the configuration with the most output tok/s at
    // its feasible points: its table per bucket, and caps over all of them.
    let score = |c: &ConfigResult| -> f64 {
        c.buckets
            .iter()
            .filter_map(|b| b.at_feasible.as_ref().map(|p| p.output_tok_per_s))
            .sum()
    };
    // Only a configuration with a safe point somewhere can be selected.
    let best = configs
        .iter()
        .filter(|c| has_safe_point(c))
        .max_by(|a, b| score(a).total_cmp(&score(b)));
    let limits = best
        .map(|c| Limits::from_config(c, kv_tokens_limit(c, cfg.slo.headroom), cfg.slo.headroom));
    let no_safe_point = best.is_none().then(|| why_no_safe_point(&configs));
    let (quality, quality_error) = match score_quality(cfg, best) {
        Ok(q) => (q, None),
        Err(e) => (None, Some(e)),
    };
    let profile = Profile {
        schema: PROFILE_SCHEMA.into(),
        created_unix_ms: envelope_telemetry::unix_ms(),
        fingerprint,
        slo: cfg.slo.clone(),
        selected: best.map(|c| c.name.clone()).unwrap_or_default(),
        configs,
        limits,
        no_safe_point,
        probes_total,
        quality,
        load: Some(envelope_profile::LoadShape {
            mode: cfg.load.mode.clone(),
            ramp: cfg.load.ramp && !cfg.load.is_open_loop(),
            rounds: cfg.load.rounds,
            min_requests: cfg.load.min_requests,
            max_requests: cfg.load.max_requests,
        }),
    };
    SweepOutput {
        profile,
        quality_error,
        requests: rows.0,
        probes: rows.1,
        telemetry,
    }
}

/// A model known by the name sent in requests (`kind: served`) is
/// recorded as the server names it in `/v1/models` (llama.cpp's server
/// answers any name but lists its model file), so a governor's check
/// compares like with like; the name the config sent is kept as
/// `requested`.
fn record_served_model(fingerprint: &mut serde_json::Value, configs: &[ConfigResult]) {
    let Some(model) = fingerprint.get_mut("model") else {
        return;
    };
    if model.get("kind").and_then(|k| k.as_str()) != Some("served") {
        return;
    }
    let served: Vec<&String> = configs
        .iter()
        .filter_map(|c| c.server_checks.as_ref())
        .flat_map(|c| &c.served_models)
        .collect();
    let requested = model.get("id").and_then(|i| i.as_str()).unwrap_or_default();
    if served.is_empty() || served.iter().any(|s| *s == requested) {
        return;
    }
    let id = served[0].clone();
    model["requested"] = requested.into();
    model["id"] = id.into();
}

/// Whether a configuration ran without a setup error and was feasible at
/// some load in at least one bucket.
fn has_safe_point(c: &ConfigResult) -> bool {
    c.error.is_none() && c.buckets.iter().any(|b| b.feasible_concurrency >= 1)
}

/// Why no configuration has a safe point, one clause per configuration:
/// its setup error, or each bucket's binding constraint at the lowest load.
pub fn why_no_safe_point(configs: &[ConfigResult]) -> String {
    if configs.is_empty() {
        return "the sweep ran no configuration".into();
    }
    configs
        .iter()
        .map(|c| {
            let why = match &c.error {
                Some(e) => e.clone(),
                None if c.buckets.is_empty() => "no bucket was probed".into(),
                None => {
                    let per_bucket: Vec<String> = c
                        .buckets
                        .iter()
                        .map(|b| {
                            let lowest = b.probes.iter().map(|p| p.concurrency).min().unwrap_or(0);
                            format!(
                                "{}x{} breached {} already at concurrency {lowest}",
                                b.input_tokens,
                                b.output_tokens,
                                b.binding_constraint.as_str()
                            )
                        })
                        .collect();
                    format!("no bucket was safe at any load: {}", per_bucket.join("; "))
                }
            };
            format!("{}: {why}", c.name)
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

impl SweepOutput {
    /// Writes `profile.json`, `report.md`, `report.html`, `plots/*.svg`,
    /// `requests.csv`, `probes.csv` and `telemetry.csv` into `dir`.
    pub fn write(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("profile.json"),
            serde_json::to_string_pretty(&self.profile)?,
        )?;
        crate::report::write_all(&self.profile, dir)?;
        let mut w = csv::Writer::from_path(dir.join("requests.csv"))?;
        for r in &self.requests {
            w.serialize(r)?;
        }
        w.flush()?;
        let mut w = csv::Writer::from_path(dir.join("probes.csv"))?;
        for r in &self.probes {
            w.serialize(r)?;
        }
        w.flush()?;
        let mut w = csv::Writer::from_path(dir.join("telemetry.csv"))?;
        for r in &self.telemetry {
            w.serialize(r)?;
        }
        w.flush()?;
        Ok(())
    }
}
