//! The sweep: every matrix point, every bucket, a bracket search over
//! concurrency; an OOM or failed load is recorded and the sweep goes on.

use crate::config::{BenchConfig, MatrixPoint};
use crate::load::{closed_loop, ProbeRun};
use crate::stats::percentiles;
use envelope_engine::{
    EngineConfig, EngineHandle, KvBudget, LoadOptions, Precision, SchedulerConfig,
};
use envelope_profile::capacity::with_headroom;
use envelope_profile::{
    Bracket, BucketResult, ConfigResult, Constraint, Limits, MemoryReport, ProbeSummary, Profile,
    Slo, Step, PROFILE_SCHEMA,
};
use serde::Serialize;

/// One row of `requests.csv`.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRow {
    pub config: String,
    pub bucket: String,
    pub concurrency: u32,
    pub worker: u32,
    pub start_s: f64,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub preemptions: u32,
    pub error: String,
}

/// One row of `probes.csv`.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeRow {
    pub config: String,
    pub bucket: String,
    pub concurrency: u32,
    pub requests: u64,
    pub errors: u64,
    pub duration_s: f64,
    pub ttft_p95_ms: f64,
    pub itl_p95_ms: f64,
    pub e2e_p99_ms: f64,
    pub output_tok_per_s: f64,
    pub total_tok_per_s: f64,
    pub goodput_req_per_s: f64,
    pub kv_usage_max: f64,
    pub preemptions: u64,
    pub breaches: String,
}

pub struct SweepOutput {
    pub profile: Profile,
    pub requests: Vec<RequestRow>,
    pub probes: Vec<ProbeRow>,
}

/// Summarises a probe and checks it against the SLOs.
pub fn summarise(run: &ProbeRun, concurrency: u32, slo: &Slo) -> ProbeSummary {
    let ok: Vec<_> = run.records.iter().filter(|r| r.error.is_none()).collect();
    let ms = |v: f64| v * 1e3;
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s.map(ms)).collect();
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|r| r.itl_s.iter().map(|v| ms(*v)))
        .collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter(|r| r.output_tokens > 1)
        .map(|r| ms((r.e2e_s - r.ttft_s.unwrap_or(0.0)) / (r.output_tokens - 1) as f64))
        .collect();
    let e2e: Vec<f64> = ok.iter().map(|r| ms(r.e2e_s)).collect();
    let d = run.duration_s.max(1e-9);
    let out_tokens: u64 = ok.iter().map(|r| r.output_tokens as u64).sum();
    let in_tokens: u64 = ok.iter().map(|r| r.input_tokens as u64).sum();
    let prefill_time: f64 = ok.iter().filter_map(|r| r.ttft_s).sum::<f64>().max(1e-9);
    let meets = |r: &&&crate::load::RequestRecord| {
        slo.ttft_p95_ms
            .is_none_or(|t| r.ttft_s.is_some_and(|x| ms(x) <= t))
            && slo.e2e_p99_ms.is_none_or(|t| ms(r.e2e_s) <= t)
    };
    let good = ok.iter().filter(|r| meets(r)).count();
    let mut s = ProbeSummary {
        concurrency,
        requests: run.records.len() as u64,
        errors: (run.records.len() - ok.len()) as u64,
        duration_s: run.duration_s,
        ttft_ms: percentiles(&ttft),
        itl_ms: percentiles(&itl),
        tpot_ms: percentiles(&tpot),
        e2e_ms: percentiles(&e2e),
        // Per-request prefill rate, summed over the concurrent requests.
        prefill_tok_per_s: in_tokens as f64 / prefill_time * concurrency as f64,
        decode_tok_per_s: out_tokens.saturating_sub(ok.len() as u64) as f64 / d,
        output_tok_per_s: out_tokens as f64 / d,
        total_tok_per_s: (in_tokens + out_tokens) as f64 / d,
        request_per_s: ok.len() as f64 / d,
        goodput_req_per_s: good as f64 / d,
        offered_rate_per_s: None,
        kv_usage_max: Some(run.kv_usage_max),
        preemptions: Some(run.preemptions),
        peak_memory_bytes: run.peak_rss_bytes,
        breaches: vec![],
        // A worker that idled between its requests for over 100 ms (or a quarter
        // of a median request) was not keeping the load closed.
        valid: run.max_client_gap_s < (0.25 * percentiles(&e2e).p50 / 1e3).max(0.1),
    };
    s.breaches = breaches(&s, slo);
    s
}

/// The SLOs a probe breached, the KV cache first (it is what runs out).
pub fn breaches(s: &ProbeSummary, slo: &Slo) -> Vec<Constraint> {
    let mut b = vec![];
    let preempted = s.preemptions.unwrap_or(0) > 0;
    if (slo.zero_preemptions && preempted)
        || s.kv_usage_max.is_some_and(|k| k > slo.max_kv_usage + 1e-9)
    {
        b.push(Constraint::KvCache);
        if preempted {
            b.push(Constraint::Preemption);
        }
    }
    if s.requests == 0 || s.errors as f64 / s.requests as f64 > slo.max_error_rate {
        b.push(Constraint::Errors);
    }
    if slo.ttft_p95_ms.is_some_and(|t| s.ttft_ms.p95 > t) {
        b.push(Constraint::TtftP95);
    }
    if slo.itl_p95_ms.is_some_and(|t| s.itl_ms.p95 > t) {
        b.push(Constraint::ItlP95);
    }
    if slo.e2e_p99_ms.is_some_and(|t| s.e2e_ms.p99 > t) {
        b.push(Constraint::E2eP99);
    }
    if !s.valid {
        b.push(Constraint::ClientLimited);
    }
    b
}

/// Smallest concurrency after which doubling adds under 10% output tok/s.
pub fn knee(probes: &[ProbeSummary]) -> Option<u32> {
    let mut p: Vec<&ProbeSummary> = probes.iter().filter(|p| p.breaches.is_empty()).collect();
    p.sort_by_key(|p| p.concurrency);
    p.windows(2)
        .find(|w| {
            w[1].concurrency >= w[0].concurrency * 2
                && w[1].output_tok_per_s < w[0].output_tok_per_s * 1.1
        })
        .map(|w| w[0].concurrency)
}

fn bytes_per_param(p: Precision) -> Option<f64> {
    match p {
        Precision::F32 => Some(4.0),
        Precision::F16 | Precision::Bf16 => Some(2.0),
        Precision::Q8_0 => Some(34.0 / 32.0),
        Precision::Q4_0 => Some(18.0 / 32.0),
        Precision::AsStored => None,
    }
}

fn run_point(
    cfg: &BenchConfig,
    point: &MatrixPoint,
    probes_total: &mut u32,
    rows: &mut (Vec<RequestRow>, Vec<ProbeRow>),
    progress: &mut dyn FnMut(&str),
) -> ConfigResult {
    let name = point.name();
    let mut result = ConfigResult {
        name: name.clone(),
        precision: point.precision.to_string(),
        kv_dtype: point.kv_dtype.to_string(),
        batch_policy: point.policy.to_string(),
        max_num_seqs: cfg.max_num_seqs,
        memory: MemoryReport::default(),
        buckets: vec![],
        error: None,
    };
    let loaded = match envelope_engine::load(
        &cfg.model,
        &LoadOptions {
            precision: point.precision,
            tokenizer: None,
        },
    ) {
        Ok(l) => l,
        Err(e) => {
            result.error = Some(format!("load failed: {e}"));
            return result;
        }
    };
    let params = loaded.info.weights.num_parameters as f64;
    let weight_bytes = loaded.info.weights.total_bytes as u64;
    let ecfg = EngineConfig {
        kv_dtype: point.kv_dtype,
        kv_budget: KvBudget::Bytes(cfg.kv_cache_bytes),
        block_size: cfg.block_size,
        scheduler: SchedulerConfig {
            policy: point.policy,
            max_num_seqs: cfg.max_num_seqs as usize,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            chunked_prefill: true,
        },
        max_model_len: None,
    };
    let engine = match EngineHandle::spawn(loaded, &ecfg) {
        Ok(e) => e,
        Err(e) => {
            result.error = Some(format!("engine start failed: {e}"));
            return result;
        }
    };
    result.memory = MemoryReport {
        weight_bytes,
        weight_bytes_analytic: bytes_per_param(point.precision)
            .map_or(weight_bytes, |b| (params * b) as u64),
        kv_bytes_per_token: engine.info.kv_bytes_per_token as u64,
        kv_capacity_tokens: engine.info.kv_capacity_tokens as u64,
        peak_bytes: None,
    };
    for bucket in &cfg.buckets {
        let bname = format!("{}x{}", bucket.input_tokens, bucket.output_tokens);
        let mut bracket = Bracket::new(
            cfg.concurrency_min,
            cfg.concurrency_max.min(cfg.max_num_seqs),
        );
        let mut probes = vec![];
        while let Step::Probe(c) = bracket.next() {
            progress(&format!("{name} {bname}: probing concurrency {c}"));
            let total = (c * cfg.load.rounds).max(cfg.load.min_requests);
            let run = closed_loop(&engine, *bucket, c, total, *probes_total as u64 * 1000);
            *probes_total += 1;
            let s = summarise(&run, c, &cfg.slo);
            bracket.record(c, s.breaches.is_empty());
            for r in &run.records {
                rows.0.push(RequestRow {
                    config: name.clone(),
                    bucket: bname.clone(),
                    concurrency: c,
                    worker: r.worker,
                    start_s: r.start_s,
                    ttft_ms: r.ttft_s.map(|t| t * 1e3),
                    tpot_ms: (r.output_tokens > 1).then(|| {
                        (r.e2e_s - r.ttft_s.unwrap_or(0.0)) * 1e3 / (r.output_tokens - 1) as f64
                    }),
                    e2e_ms: r.e2e_s * 1e3,
                    input_tokens: r.input_tokens,
                    output_tokens: r.output_tokens,
                    preemptions: r.preemptions,
                    error: r.error.clone().unwrap_or_default(),
                });
            }
            rows.1.push(ProbeRow {
                config: name.clone(),
                bucket: bname.clone(),
                concurrency: c,
                requests: s.requests,
                errors: s.errors,
                duration_s: s.duration_s,
                ttft_p95_ms: s.ttft_ms.p95,
                itl_p95_ms: s.itl_ms.p95,
                e2e_p99_ms: s.e2e_ms.p99,
                output_tok_per_s: s.output_tok_per_s,
                total_tok_per_s: s.total_tok_per_s,
                goodput_req_per_s: s.goodput_req_per_s,
                kv_usage_max: s.kv_usage_max.unwrap_or(0.0),
                preemptions: s.preemptions.unwrap_or(0),
                breaches: s
                    .breaches
                    .iter()
                    .map(|b| b.as_str())
                    .collect::<Vec<_>>()
                    .join("+"),
            });
            result.memory.peak_bytes = result.memory.peak_bytes.max(s.peak_memory_bytes);
            probes.push(s);
        }
        let feasible = bracket.feasible.unwrap_or(0);
        let binding = match bracket.infeasible {
            Some(i) => probes
                .iter()
                .find(|p| p.concurrency == i)
                .and_then(|p| p.breaches.first().copied())
                .unwrap_or(Constraint::Errors),
            None => Constraint::SearchCap,
        };
        result.buckets.push(BucketResult {
            input_tokens: bucket.input_tokens,
            output_tokens: bucket.output_tokens,
            feasible_concurrency: feasible,
            infeasible_concurrency: bracket.infeasible,
            safe_concurrency: with_headroom(feasible, cfg.slo.headroom),
            binding_constraint: binding,
            knee_concurrency: knee(&probes),
            at_feasible: probes
                .iter()
                .find(|p| p.concurrency == feasible && p.breaches.is_empty())
                .cloned(),
            feasible_rate_per_s: None,
            safe_rate_per_s: None,
            probes,
        });
    }
    engine.shutdown();
    result
}

/// Runs the whole sweep. `progress` hears one line per probe.
pub fn run_sweep(
    cfg: &BenchConfig,
    fingerprint: serde_json::Value,
    progress: &mut dyn FnMut(&str),
) -> SweepOutput {
    let mut probes_total = 0;
    let mut rows = (vec![], vec![]);
    let configs: Vec<ConfigResult> = cfg
        .points
        .iter()
        .map(|p| run_point(cfg, p, &mut probes_total, &mut rows, progress))
        .collect();
    // The limits come from the configuration with the most output tok/s at
    // its feasible points, and hold for every bucket of it.
    let score = |c: &ConfigResult| -> f64 {
        c.buckets
            .iter()
            .filter_map(|b| b.at_feasible.as_ref().map(|p| p.output_tok_per_s))
            .sum()
    };
    let best = configs
        .iter()
        .filter(|c| c.error.is_none() && !c.buckets.is_empty())
        .max_by(|a, b| score(a).total_cmp(&score(b)));
    let limits = match best {
        Some(c) => Limits {
            max_context_tokens: c
                .buckets
                .iter()
                .map(|b| (b.input_tokens + b.output_tokens) as u64)
                .max()
                .unwrap_or(1),
            max_output_tokens: c
                .buckets
                .iter()
                .map(|b| b.output_tokens as u64)
                .max()
                .unwrap_or(1),
            max_concurrent_seqs: c
                .buckets
                .iter()
                .map(|b| b.safe_concurrency as u64)
                .min()
                .unwrap_or(0)
                .max(1),
            max_kv_tokens_in_flight: ((c.memory.kv_capacity_tokens as f64)
                * (1.0 - cfg.slo.headroom))
                .floor()
                .max(1.0) as u64,
        },
        None => Limits {
            max_context_tokens: 1,
            max_output_tokens: 1,
            max_concurrent_seqs: 1,
            max_kv_tokens_in_flight: 1,
        },
    };
    let profile = Profile {
        schema: PROFILE_SCHEMA.into(),
        created_unix_ms: envelope_telemetry::unix_ms(),
        fingerprint,
        slo: cfg.slo.clone(),
        selected: best.map(|c| c.name.clone()).unwrap_or_default(),
        configs,
        limits,
        probes_total,
        quality: None,
    };
    SweepOutput {
        profile,
        requests: rows.0,
        probes: rows.1,
    }
}

impl SweepOutput {
    /// Writes `profile.json`, `report.md`, `report.html`, `requests.csv` and
    /// `probes.csv` into `dir`.
    pub fn write(&self, dir: &std::path::Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("profile.json"),
            serde_json::to_string_pretty(&self.profile)?,
        )?;
        std::fs::write(
            dir.join("report.md"),
            crate::report::markdown(&self.profile),
        )?;
        std::fs::write(dir.join("report.html"), crate::report::html(&self.profile))?;
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
        Ok(())
    }
}
