//! The pure half of the sweep: a probe's records summarised and judged
//! against the SLOs, the throughput knee, a bucket's result from its
//! search, and the KV tokens the governor may reserve. No I/O: the sweep
//! (`super`) runs the probes and calls these.

use crate::config::{Bucket, LoadConfig};
use crate::load::ProbeRun;
use crate::load::StopWhen;
use crate::record::RequestRecord;
use envelope_profile::capacity::with_headroom;
use envelope_profile::confidence::{self, Decision};
use envelope_profile::Percentiles;
use envelope_profile::{
    BucketRepeat, BucketResult, CachedPrefix, ConfigResult, Constraint, LevelSearch, LevelVerdict,
    ProbeSummary, Slo, SloCheck,
};
use std::sync::Arc;

/// Each latency SLO's evidence in the `records` that did not fail: TTFT and
/// end-to-end latency per request, ITL per token gap.
pub fn slo_checks<'a, I>(records: I, slo: &Slo) -> Vec<SloCheck>
where
    I: Iterator<Item = &'a RequestRecord> + Clone,
{
    let ok = records.filter(|r| r.error.is_none() && r.retry_after_s.is_none() && !r.warmup);
    let ms = |v: f64| v * 1e3;
    let check = |slo_c, limit_ms: f64, percentile, (samples, over): (u64, u64)| {
        let c = slo.confidence;
        SloCheck {
            slo: slo_c,
            limit_ms,
            percentile,
            samples,
            over,
            over_share_lower: confidence::rate_lower_bound(over, samples, c),
            over_share_upper: confidence::rate_upper_bound(over, samples, c),
            decision: slo.test(percentile).decide(over, samples),
        }
    };
    let count = |xs: &mut dyn Iterator<Item = f64>, limit: f64| {
        xs.fold((0u64, 0u64), |(n, o), x| (n + 1, o + u64::from(x > limit)))
    };
    let mut out = vec![];
    if let Some(t) = slo.ttft_p95_ms {
        let mut xs = ok.clone().filter_map(|r| r.ttft_s.map(ms));
        out.push(check(Constraint::TtftP95, t, 0.95, count(&mut xs, t)));
    }
    if let Some(t) = slo.itl_p95_ms {
        let mut xs = ok.clone().flat_map(|r| r.itl_s.iter().map(|v| ms(*v)));
        out.push(check(Constraint::ItlP95, t, 0.95, count(&mut xs, t)));
    }
    if let Some(t) = slo.e2e_p99_ms {
        let mut xs = ok.clone().map(|r| ms(r.e2e_s));
        out.push(check(Constraint::E2eP99, t, 0.99, count(&mut xs, t)));
    }
    out
}

/// Whether a constraint is a latency percentile (decided from a sample)
/// rather than a limit crossed outright (the KV cache, errors, a crash).
fn is_percentile(c: Constraint) -> bool {
    matches!(
        c,
        Constraint::TtftP95 | Constraint::ItlP95 | Constraint::E2eP99 | Constraint::Undecided
    )
}

/// A probe's verdict at `slo.confidence`: breached when a limit that is
/// not a percentile was crossed or a latency SLO was decided breached;
/// holds when every latency SLO held; else undecided. A summary without
/// checks (before confidence) holds when it breached nothing.
pub fn decision(s: &ProbeSummary) -> Decision {
    if s.slo_checks.is_empty() {
        return if s.breaches.is_empty() {
            Decision::Holds
        } else {
            Decision::Breached
        };
    }
    if s.breaches.iter().any(|c| !is_percentile(*c))
        || s.slo_checks
            .iter()
            .any(|c| c.decision == Decision::Breached)
    {
        Decision::Breached
    } else if s.slo_checks.iter().all(|c| c.decision == Decision::Holds) {
        Decision::Holds
    } else {
        Decision::Undecided
    }
}

/// What the level search takes from a probe: its decision, or while it
/// is undecided, what its figures show (`LooksOk`, `LooksBad`) when it
/// was only screened, and `Undecided` once it was extended to its budget.
pub fn level_verdict(s: &ProbeSummary, extended: bool) -> LevelVerdict {
    match decision(s) {
        Decision::Holds => LevelVerdict::Holds,
        Decision::Breached => LevelVerdict::Breached,
        Decision::Undecided if extended => LevelVerdict::Undecided,
        Decision::Undecided if s.breaches.is_empty() => LevelVerdict::LooksOk,
        Decision::Undecided => LevelVerdict::LooksBad,
    }
}

/// The fewest requests of `output_tokens` each that can show every latency
/// SLO holds (none over the limit): 41 for a p95 at 90% with the default
/// zone, 108 for a p99 (see [`confidence::SequentialTest::min_requests`]);
/// ITL counts token gaps. 0 with no latency SLO.
pub fn requests_to_decide(slo: &Slo, output_tokens: u32) -> u32 {
    let per_request = [(slo.ttft_p95_ms, 0.95), (slo.e2e_p99_ms, 0.99)]
        .into_iter()
        .filter(|(t, _)| t.is_some())
        .map(|(_, p)| slo.test(p).min_requests())
        .max()
        .unwrap_or(0);
    let gaps = u64::from(output_tokens.saturating_sub(1).max(1));
    let per_gap = slo
        .itl_p95_ms
        .map_or(0, |_| slo.test(0.95).min_requests().div_ceil(gaps));
    per_request.max(per_gap) as u32
}

/// How many times [`requests_to_decide`] a level may spend by default to
/// decide its verdicts (`load.max_requests` unset). Twice was measured on
/// the quickstart and saved no time: levels on a latency plateau along
/// the limit then ended undecided one after another, each at the budget,
/// and safe points fell by up to three levels
/// (docs/measurements/2026-12-05-quickstart-sweep-time.md).
pub const DECIDE_BUDGET_FACTOR: u32 = 4;

/// The most requests a level's probes may send to decide its verdicts:
/// `load.max_requests`, or [`DECIDE_BUDGET_FACTOR`] times what the SLOs
/// need at the least, and never fewer than a screening probe.
pub fn max_requests(load: &LoadConfig, slo: &Slo, output_tokens: u32) -> u32 {
    load.max_requests
        .unwrap_or(DECIDE_BUDGET_FACTOR * requests_to_decide(slo, output_tokens))
        .max(load.min_requests)
}

/// The fewest more requests after which every latency SLO would hold by
/// the sequential test if none of them were over its limit (the size of the
/// next chunk of a probe being decided); ITL counts `output_tokens - 1`
/// gaps a request. `None` when an SLO is already breached or none is set;
/// 0 when all hold.
pub fn requests_to_hold(records: &[RequestRecord], slo: &Slo, output_tokens: u32) -> Option<u32> {
    let checks = slo_checks(records.iter(), slo);
    if checks.is_empty() || checks.iter().any(|c| c.decision == Decision::Breached) {
        return None;
    }
    let gaps = u64::from(output_tokens.saturating_sub(1).max(1));
    checks
        .iter()
        .map(|c| {
            let more = slo.test(c.percentile).requests_to_hold(c.over, c.samples);
            if c.slo == Constraint::ItlP95 {
                more.div_ceil(gaps)
            } else {
                more
            }
        })
        .max()
        .map(|m| m.min(u64::from(u32::MAX)) as u32)
}

/// Stops a probe once its verdict is decided: a latency SLO breached, or
/// (with no failure allowed) a request failed, at any time; every latency
/// SLO held, once the level has `at_least` requests (a screening probe
/// sends its whole count: the KV cache and preemptions are only seen under
/// the whole load). `before` are the level's earlier requests, when the
/// probe extends them. Never with no latency SLO and failures allowed.
pub fn stop_when_decided(slo: &Slo, before: Vec<RequestRecord>, at_least: usize) -> StopWhen {
    let slo = slo.clone();
    Arc::new(move |records: &[RequestRecord]| {
        let all = before.iter().chain(records);
        if slo.max_error_rate == 0.0
            && all
                .clone()
                .any(|r| r.error.is_some() && r.retry_after_s.is_none())
        {
            return true;
        }
        let checks = slo_checks(all, &slo);
        let enough = before.len() + records.len() >= at_least;
        !checks.is_empty()
            && (checks.iter().any(|c| c.decision == Decision::Breached)
                || (enough && checks.iter().all(|c| c.decision == Decision::Holds)))
    })
}

/// Summarises a probe and checks it against the SLOs (and, for its
/// validity, against `load`'s client tolerances).
pub fn summarise(run: &ProbeRun, concurrency: u32, slo: &Slo, load: &LoadConfig) -> ProbeSummary {
    let ok: Vec<_> = run.records.iter().filter(|r| r.error.is_none()).collect();
    // Latencies are the level's: the warm-up (sent while workers ramped
    // in) counts in the throughput, not in the percentiles.
    let steady: Vec<_> = ok.iter().filter(|r| !r.warmup).collect();
    let ms = |v: f64| v * 1e3;
    let ttft: Vec<f64> = steady.iter().filter_map(|r| r.ttft_s.map(ms)).collect();
    let itl: Vec<f64> = steady
        .iter()
        .flat_map(|r| r.itl_s.iter().map(|v| ms(*v)))
        .collect();
    let tpot: Vec<f64> = steady
        .iter()
        .filter(|r| r.output_tokens > 1)
        .map(|r| ms((r.e2e_s - r.ttft_s.unwrap_or(0.0)) / (r.output_tokens - 1) as f64))
        .collect();
    let e2e: Vec<f64> = steady.iter().map(|r| ms(r.e2e_s)).collect();
    let d = run.duration_s.max(1e-9);
    let out_tokens: u64 = ok.iter().map(|r| r.output_tokens as u64).sum();
    let in_tokens: u64 = ok.iter().map(|r| r.input_tokens as u64).sum();
    let prefill_time: f64 = ok.iter().filter_map(|r| r.ttft_s).sum::<f64>().max(1e-9);
    let meets = |r: &&&RequestRecord| {
        slo.ttft_p95_ms
            .is_none_or(|t| r.ttft_s.is_some_and(|x| ms(x) <= t))
            && slo.e2e_p99_ms.is_none_or(|t| ms(r.e2e_s) <= t)
    };
    let good = ok.iter().filter(|r| meets(r)).count();
    let refused = run
        .records
        .iter()
        .filter(|r| r.retry_after_s.is_some())
        .count();
    let mut s = ProbeSummary {
        concurrency,
        requests: run.records.len() as u64,
        warmup_requests: run.records.iter().filter(|r| r.warmup).count() as u64,
        errors: (run.records.len() - ok.len() - refused) as u64,
        refused: refused as u64,
        duration_s: run.duration_s,
        ttft_ms: Percentiles::of(&ttft),
        itl_ms: Percentiles::of(&itl),
        tpot_ms: Percentiles::of(&tpot),
        e2e_ms: Percentiles::of(&e2e),
        // Per-request prefill rate, summed over the concurrent requests.
        prefill_tok_per_s: in_tokens as f64 / prefill_time * concurrency as f64,
        decode_tok_per_s: out_tokens.saturating_sub(ok.len() as u64) as f64 / d,
        output_tok_per_s: out_tokens as f64 / d,
        total_tok_per_s: (in_tokens + out_tokens) as f64 / d,
        request_per_s: ok.len() as f64 / d,
        goodput_req_per_s: good as f64 / d,
        offered_rate_per_s: run.offered_rate_per_s,
        kv_usage_max: run.kv_usage_max,
        preemptions: run.preemptions,
        prefix_cache_hit_rate: hit_rate(run),
        peak_memory_bytes: run.peak_memory_bytes,
        breaches: vec![],
        // A worker that idled between its requests for over
        // `load.max_client_gap_ms` (100 ms by default, or a quarter of a
        // median request) was not keeping the load closed; an open loop that
        // sent over `load.max_late_fraction` (5%) of its arrivals late was not
        // open; a load generator using over 90% of the cores measured itself.
        client_cpu_fraction: run.client_cpu_fraction,
        valid: run.max_client_gap_s
            < (0.25 * Percentiles::of(&e2e).p50).max(load.max_client_gap_ms) / 1e3
            && run.late_fraction <= load.max_late_fraction
            && run.client_cpu_fraction.is_none_or(|f| f <= 0.9),
        error_reasons: crate::truth::reasons(&run.records),
        slo_checks: slo_checks(run.records.iter(), slo),
    };
    s.breaches = breaches(&s, slo);
    s
}

/// The SLOs a probe breached, the KV cache first (it is what runs out). A
/// latency SLO is breached when its check decided so, or, undecided, when
/// more than its share of the sample was over the limit (the point
/// estimate the search screens with). A summary without checks compares
/// its percentiles with the limits.
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
    // Failures as a share of the admitted requests; refusals apart.
    let admitted = s.requests.saturating_sub(s.refused);
    if s.requests == 0 || (admitted > 0 && s.errors as f64 / admitted as f64 > slo.max_error_rate) {
        b.push(Constraint::Errors);
    }
    if s.requests > 0 && s.refused as f64 / s.requests as f64 > slo.max_shed_rate {
        b.push(Constraint::Shed);
    }
    if s.slo_checks.is_empty() {
        if slo.ttft_p95_ms.is_some_and(|t| s.ttft_ms.p95 > t) {
            b.push(Constraint::TtftP95);
        }
        if slo.itl_p95_ms.is_some_and(|t| s.itl_ms.p95 > t) {
            b.push(Constraint::ItlP95);
        }
        if slo.e2e_p99_ms.is_some_and(|t| s.e2e_ms.p99 > t) {
            b.push(Constraint::E2eP99);
        }
    }
    for c in &s.slo_checks {
        let over_share = c.over as f64 / c.samples.max(1) as f64;
        let breached = match c.decision {
            Decision::Breached => true,
            Decision::Holds => false,
            Decision::Undecided => over_share > 1.0 - c.percentile + 1e-12,
        };
        if breached {
            b.push(c.slo);
        }
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

/// A bucket's result from its search: the feasible level (closed loop: the
/// concurrency; open loop: the most requests in flight at the feasible
/// rate), the safe one after `headroom`, the binding constraint (the first
/// breach of the smallest infeasible level, or the search cap), the knee,
/// and the interval the feasible level is known within (up to one below
/// the lowest level decided breached).
pub fn bucket_result(
    load: &LoadConfig,
    headroom: f64,
    bucket: Bucket,
    search: &LevelSearch,
    probes: Vec<(u32, ProbeSummary)>,
) -> BucketResult {
    let open_loop_mode = load.is_open_loop();
    let at = |k: u32| {
        probes
            .iter()
            .find(|(l, p)| *l == k && p.breaches.is_empty())
            .map(|(_, p)| p.clone())
    };
    let at_feasible = search.feasible().and_then(at);
    let binding = match search.infeasible() {
        Some(i) => probes
            .iter()
            .find(|(l, _)| *l == i)
            .and_then(|(_, p)| p.breaches.first().copied())
            .unwrap_or(Constraint::Errors),
        None => Constraint::SearchCap,
    };
    // Closed loop: the searched concurrency. Open loop: the most requests
    // seen in flight at the feasible rate.
    let feasible = if open_loop_mode {
        at_feasible.as_ref().map_or(0, |p| p.concurrency)
    } else {
        search.feasible().unwrap_or(0)
    };
    let rate = |k: u32| k as f64 * load.rate_step_per_s;
    let feasible_rate = open_loop_mode
        .then(|| search.feasible().map(rate))
        .flatten();
    let feasible_upper = search
        .upper()
        .map(|u| if open_loop_mode { rate(u) } else { u as f64 });
    let summaries: Vec<ProbeSummary> = probes.into_iter().map(|(_, p)| p).collect();
    // A warm bucket: the server's hits over all its probes, weighted by
    // their requests, against the share meant to be cached.
    let cached_prefix = bucket.cached_share().map(|share| {
        let (hits, weight) = summaries
            .iter()
            .filter_map(|p| p.prefix_cache_hit_rate.map(|h| (h, p.requests as f64)))
            .fold((0.0, 0.0), |(a, w), (h, n)| (a + h * n, w + n));
        CachedPrefix::judged(share, (weight > 0.0).then(|| hits / weight))
    });
    BucketResult {
        input_tokens: bucket.input_tokens,
        output_tokens: bucket.output_tokens,
        feasible_concurrency: feasible,
        infeasible_concurrency: if open_loop_mode {
            None
        } else {
            search.infeasible()
        },
        safe_concurrency: with_headroom(feasible, headroom),
        binding_constraint: binding,
        knee_concurrency: if open_loop_mode {
            None
        } else {
            knee(&summaries)
        },
        at_feasible,
        feasible_rate_per_s: feasible_rate,
        safe_rate_per_s: feasible_rate.map(|r| r * (1.0 - headroom)),
        feasible_upper,
        safe_upper: feasible_upper.map(|u| {
            if open_loop_mode {
                u * (1.0 - headroom)
            } else {
                with_headroom(u as u32, headroom) as f64
            }
        }),
        repeats: vec![],
        cached_prefix,
        probes: summaries,
    }
}

/// The share of prompt tokens the server found in its prefix cache over a
/// probe: from its counters where it exports them (vLLM), else from the
/// answers that said (`cached_tokens`, llama.cpp's server); `None` where
/// neither told.
pub fn hit_rate(run: &ProbeRun) -> Option<f64> {
    if let Some(c) = run.prefix_cache.filter(|c| c.queries > 0.0) {
        return Some((c.hits / c.queries).clamp(0.0, 1.0));
    }
    let (cached, input) = run
        .records
        .iter()
        .filter_map(|r| {
            r.cached_tokens
                .map(|c| (u64::from(c), u64::from(r.input_tokens)))
        })
        .fold((0u64, 0u64), |(c, i), (rc, ri)| (c + rc, i + ri));
    (input > 0).then(|| (cached as f64 / input as f64).clamp(0.0, 1.0))
}

/// KV tokens the governor may reserve: the capacity less the headroom; when
/// the capacity is unknown (a server whose metrics do not say), what the
/// safe points of the buckets use at most.
pub fn kv_tokens_limit(c: &ConfigResult, headroom: f64) -> u64 {
    let limit = if c.memory.kv_capacity_tokens > 0 {
        (c.memory.kv_capacity_tokens as f64 * (1.0 - headroom)).floor() as u64
    } else {
        c.buckets
            .iter()
            .filter(|b| b.is_cold())
            .map(|b| b.safe_concurrency as u64 * (b.input_tokens + b.output_tokens) as u64)
            .max()
            .unwrap_or(0)
    };
    limit.max(1)
}

/// One result per configuration from the repeats of the whole search
/// (each holding every configuration, in the same order). With one
/// repeat, that repeat. With more, each bucket is the repeat with the
/// lower median safe point (the figures a single search would have given,
/// chosen without favouring the lucky run) and lists every repeat's
/// search; a configuration's peak memory is the highest of its repeats,
/// and an error in any repeat is kept.
pub fn merge_repeats(mut repeats: Vec<Vec<ConfigResult>>) -> Vec<ConfigResult> {
    if repeats.len() <= 1 {
        return repeats.pop().unwrap_or_default();
    }
    let rest = repeats.split_off(1);
    let mut merged = repeats.pop().unwrap_or_default();
    for (i, c) in merged.iter_mut().enumerate() {
        let all: Vec<&ConfigResult> = std::iter::once(&*c)
            .chain(rest.iter().filter_map(|r| r.get(i)))
            .collect();
        let buckets: Vec<BucketResult> = c
            .buckets
            .iter()
            .map(|b| {
                let key = b.label();
                let mut runs: Vec<&BucketResult> = all
                    .iter()
                    .filter_map(|c| c.buckets.iter().find(|x| x.label() == key))
                    .collect();
                let searches = runs
                    .iter()
                    .map(|x| BucketRepeat {
                        feasible_concurrency: x.feasible_concurrency,
                        safe_concurrency: x.safe_concurrency,
                        probes: x.probes.clone(),
                    })
                    .collect();
                // Stable: equal safe points keep run order.
                runs.sort_by_key(|x| x.safe_concurrency);
                let mut chosen = runs[(runs.len() - 1) / 2].clone();
                chosen.repeats = searches;
                chosen
            })
            .collect();
        let peak = all.iter().filter_map(|c| c.memory.peak_bytes).max();
        let error = all.iter().find_map(|c| c.error.clone());
        c.buckets = buckets;
        c.memory.peak_bytes = peak;
        c.error = error;
    }
    merged
}

#[cfg(test)]
mod tests;
