//! The rows of the sweep's CSV files (`requests.csv`, `probes.csv`,
//! `telemetry.csv`; `probes.csv`'s also go out as `envelope sweep --json`
//! lines), made from each probe as it ends.

use super::{summary, Ctx};
use crate::load::ProbeRun;
use envelope_profile::confidence::Decision;
use envelope_profile::ProbeSummary;
use serde::Serialize;

/// One row of `requests.csv`.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRow {
    /// Joins with `probes.csv`.
    pub probe: u32,
    /// The repeat of the whole search it ran in (`load.repeats`; from 0).
    pub repeat: u32,
    pub config: String,
    pub bucket: String,
    /// The probe's concurrency (open loop: the most in flight).
    pub concurrency: u32,
    /// Closed loop: the worker; open loop: the arrival's index.
    pub worker: u32,
    pub start_s: f64,
    /// Sent while the workers ramped in: not in the probe's verdicts.
    pub warmup: bool,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub preemptions: u32,
    /// Agent-shaped load: the task class and run (session) of the call.
    pub class: String,
    pub run: u32,
    /// A replayed trace: the call's tenant.
    pub tenant: String,
    pub finish_reason: String,
    /// Why the request failed (`short_output`, `stream_cut`, `http_429`,
    /// ...; see `envelope_harness::truth`); empty for a whole answer.
    pub error_reason: String,
    pub error: String,
}

/// One row of `probes.csv` (and of `envelope sweep --json`).
#[derive(Debug, Clone, Serialize)]
pub struct ProbeRow {
    pub probe: u32,
    /// The repeat of the whole search it ran in (`load.repeats`; from 0).
    pub repeat: u32,
    pub config: String,
    pub bucket: String,
    /// Closed loop: the concurrency; open loop: the most requests in flight.
    pub concurrency: u32,
    /// Open loop: the Poisson arrival rate.
    pub offered_rate_per_s: Option<f64>,
    /// The searched value (concurrency, or rate in `load.rate_step_per_s` steps).
    pub ladder: u32,
    pub requests: u64,
    /// Of `requests`, sent while the workers ramped in.
    pub warmup_requests: u64,
    /// Failed requests (refusals not included).
    pub errors: u64,
    /// Refused with 429 and Retry-After (a governed target shedding load).
    pub refused: u64,
    /// refused / requests.
    pub shed_rate: f64,
    pub duration_s: f64,
    pub ttft_p95_ms: f64,
    pub itl_p95_ms: f64,
    pub e2e_p99_ms: f64,
    pub prefill_tok_per_s: f64,
    pub decode_tok_per_s: f64,
    pub output_tok_per_s: f64,
    pub total_tok_per_s: f64,
    pub goodput_req_per_s: f64,
    pub kv_usage_max: Option<f64>,
    pub preemptions: Option<u64>,
    /// Prompt tokens found in the server's prefix cache over those looked
    /// up (empty: the server exports no counters).
    pub prefix_cache_hit_rate: Option<f64>,
    pub peak_memory_bytes: Option<u64>,
    /// False when the load generator could not keep up.
    pub valid: bool,
    pub breaches: String,
    /// A probe that extended an earlier one at the same level until its
    /// verdict was decided: that probe's id. Its figures cover both
    /// probes' requests; `requests.csv` lists each under its own id.
    pub extends: Option<u32>,
    /// The verdict at `slo.confidence`: `holds`, `breached` or `undecided`.
    pub decision: String,
}

/// One row of `telemetry.csv`: the monitor's readings during a probe.
#[derive(Debug, Clone, Serialize)]
pub struct TelemetryRow {
    pub probe: u32,
    pub t_s: f64,
    pub kv_usage: Option<f64>,
    pub memory_bytes: Option<u64>,
    pub in_flight: u32,
}

/// Appends a probe's rows: one per request of `run` (a deciding probe's
/// own requests), one for the probe (`s`, which covers the level's
/// earlier requests too when it `extends` a probe), and its telemetry.
pub(super) fn push_rows(
    ctx: &mut Ctx,
    name: &str,
    bname: &str,
    (probe_id, extends): (u32, Option<u32>),
    ladder: u32,
    run: &ProbeRun,
    s: &ProbeSummary,
) {
    for r in &run.records {
        ctx.requests.push(RequestRow {
            probe: probe_id,
            repeat: ctx.repeat,
            config: name.to_string(),
            bucket: bname.to_string(),
            concurrency: s.concurrency,
            worker: r.worker,
            start_s: r.start_s,
            warmup: r.warmup,
            ttft_ms: r.ttft_s.map(|t| t * 1e3),
            tpot_ms: (r.output_tokens > 1)
                .then(|| (r.e2e_s - r.ttft_s.unwrap_or(0.0)) * 1e3 / (r.output_tokens - 1) as f64),
            e2e_ms: r.e2e_s * 1e3,
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            preemptions: r.preemptions,
            class: r.class.clone().unwrap_or_default(),
            run: r.run,
            tenant: r.tenant.clone().unwrap_or_default(),
            finish_reason: r.finish_reason.clone().unwrap_or_default(),
            error_reason: r
                .error
                .as_deref()
                .map(crate::truth::reason_of)
                .unwrap_or_default()
                .to_string(),
            error: r.error.clone().unwrap_or_default(),
        });
    }
    ctx.telemetry
        .extend(run.series.iter().map(|p| TelemetryRow {
            probe: probe_id,
            t_s: p.t_s,
            kv_usage: p.kv_usage,
            memory_bytes: p.memory_bytes,
            in_flight: p.in_flight,
        }));
    ctx.probes.push(ProbeRow {
        probe: probe_id,
        repeat: ctx.repeat,
        config: name.to_string(),
        bucket: bname.to_string(),
        concurrency: s.concurrency,
        offered_rate_per_s: s.offered_rate_per_s,
        ladder,
        requests: s.requests,
        warmup_requests: s.warmup_requests,
        errors: s.errors,
        refused: s.refused,
        shed_rate: s.refused as f64 / s.requests.max(1) as f64,
        duration_s: s.duration_s,
        ttft_p95_ms: s.ttft_ms.p95,
        itl_p95_ms: s.itl_ms.p95,
        e2e_p99_ms: s.e2e_ms.p99,
        prefill_tok_per_s: s.prefill_tok_per_s,
        decode_tok_per_s: s.decode_tok_per_s,
        output_tok_per_s: s.output_tok_per_s,
        total_tok_per_s: s.total_tok_per_s,
        goodput_req_per_s: s.goodput_req_per_s,
        kv_usage_max: s.kv_usage_max,
        preemptions: s.preemptions,
        prefix_cache_hit_rate: s.prefix_cache_hit_rate,
        peak_memory_bytes: s.peak_memory_bytes,
        valid: s.valid,
        breaches: s
            .breaches
            .iter()
            .map(|b| b.as_str())
            .collect::<Vec<_>>()
            .join("+"),
        extends,
        decision: match summary::decision(s) {
            Decision::Holds => "holds",
            Decision::Breached => "breached",
            Decision::Undecided => "undecided",
        }
        .to_string(),
    });
}
