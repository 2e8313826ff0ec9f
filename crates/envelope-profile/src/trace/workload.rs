//! A workload derived from a trace (`envelope plan --workload-from`): one
//! task class per feature (what the caller does, `x-envelope-feature`),
//! else per trace class (BurstGPT's log type, the governor's priority
//! class), `default` for requests with neither; a run per
//! session (a request of no session is a run of one call). Rates are runs
//! over the trace's length; the p95 rate is the 95th percentile over
//! windows of a tenth of it (a minute for traces over ten minutes); token
//! counts are the requests' percentiles; a class whose runs have several
//! calls is a session, its tool-result tokens the median growth of a
//! call's prompt past its predecessor's prompt and output; the system
//! prompt is the leading blocks the runs opening with the most common
//! block share. Retries and fallbacks cannot be told from a trace:
//! amplification stays 1.

use super::{Trace, TraceRequest};
use crate::workload::{TaskClass, Workload};
use crate::Percentiles;
use std::collections::BTreeMap;

/// The workload of `trace`.
pub fn workload_from_trace(trace: &Trace) -> Workload {
    // class -> runs (each its requests in order).
    let mut runs: BTreeMap<&str, BTreeMap<String, Vec<&TraceRequest>>> = BTreeMap::new();
    for (i, r) in trace.requests.iter().enumerate() {
        let class = r
            .feature
            .as_deref()
            .or(r.class.as_deref())
            .unwrap_or("default");
        let run = match &r.session {
            Some(s) => format!("s:{s}"),
            None => format!("r:{i}"),
        };
        runs.entry(class)
            .or_default()
            .entry(run)
            .or_default()
            .push(r);
    }
    let n = trace.requests.len() as f64;
    let span = trace.span_s();
    // The trace's length as it repeats: its span and one mean gap.
    let length_s = span + if n > 1.0 { span / (n - 1.0) } else { 1.0 };
    let window_s = if length_s > 600.0 {
        60.0
    } else {
        (length_s / 10.0).max(1e-3)
    };
    let classes = runs
        .into_iter()
        .map(|(name, runs)| class_of(name, &runs, length_s, window_s))
        .collect();
    Workload {
        name: trace.name.clone(),
        reserves: Default::default(),
        scenarios: Default::default(),
        classes,
    }
}

fn class_of(
    name: &str,
    runs: &BTreeMap<String, Vec<&TraceRequest>>,
    length_s: f64,
    window_s: f64,
) -> TaskClass {
    let all: Vec<&TraceRequest> = runs.values().flatten().copied().collect();
    let input: Vec<f64> = all.iter().map(|r| f64::from(r.input_tokens)).collect();
    let output: Vec<f64> = all.iter().map(|r| f64::from(r.output_tokens)).collect();
    let (pi, po) = (Percentiles::of(&input), Percentiles::of(&output));
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    // Runs per minute, and per window for the p95.
    let starts: Vec<f64> = runs.values().map(|r| r[0].t_s).collect();
    let runs_per_min = starts.len() as f64 * 60.0 / length_s;
    let windows = (length_s / window_s).ceil().max(1.0) as usize;
    let mut counts = vec![0.0; windows];
    for t in &starts {
        counts[((t / window_s) as usize).min(windows - 1)] += 1.0;
    }
    let per_min: Vec<f64> = counts.iter().map(|c| c * 60.0 / window_s).collect();
    let p95 = Percentiles::of(&per_min).p95.max(runs_per_min);
    let calls = all.len() as f64 / runs.len().max(1) as f64;
    let session = runs.values().any(|r| r.len() > 1);
    // Growth of a session's prompt past its predecessor's prompt and output.
    let growth: Vec<f64> = runs
        .values()
        .flat_map(|r| r.windows(2))
        .map(|w| {
            (f64::from(w[1].input_tokens) - f64::from(w[0].input_tokens + w[0].output_tokens))
                .max(0.0)
        })
        .collect();
    let firsts: Vec<&TraceRequest> = runs.values().map(|r| r[0]).collect();
    let first_input: Vec<f64> = firsts.iter().map(|r| f64::from(r.input_tokens)).collect();
    // A session's input figures describe its first call (see TaskClass).
    let pin = if session {
        Percentiles::of(&first_input)
    } else {
        pi
    };
    // Three decimals: a file to read, not a measurement's precision.
    let r3 = |v: f64| (v * 1e3).round() / 1e3;
    let runs_per_min = r3(runs_per_min);
    let p95 = r3(p95);
    TaskClass {
        name: name.to_string(),
        runs_per_min,
        runs_per_min_p95: (p95 > runs_per_min).then_some(p95),
        model_calls_per_run: r3(calls),
        retry_amplification: 1.0,
        fallback_amplification: 1.0,
        input_tokens_p50: pin.p50.max(1.0),
        input_tokens_p95: pin.p95.max(pin.p50).max(1.0),
        // A session's figures describe its first call; `envelope plan`
        // adds the growth (`tool_result_tokens` and the outputs).
        input_tokens_mean: Some(r3(mean(if session { &first_input } else { &input }))),
        output_tokens_p50: po.p50.max(1.0),
        output_tokens_p95: po.p95.max(po.p50).max(1.0),
        output_tokens_mean: Some(r3(mean(&output))),
        concurrency_basis: Default::default(),
        time_in_system_s_mean: None,
        time_in_system_s_p95: None,
        dependencies_per_run: BTreeMap::new(),
        system_prompt_tokens: system_prompt(&firsts).min(pin.p50 as u32),
        session,
        tool_result_tokens: if growth.is_empty() {
            0
        } else {
            Percentiles::of(&growth).p50.round() as u32
        },
        tiers: BTreeMap::new(),
        cache_hit_rate: None,
        cache_hit_rate_floor: None,
    }
}

/// Tokens of the leading blocks shared by the runs that open with the most
/// common first block (two runs at least); 0 without blocks.
fn system_prompt(firsts: &[&TraceRequest]) -> u32 {
    let mut by_first: BTreeMap<u64, Vec<&TraceRequest>> = BTreeMap::new();
    for r in firsts {
        if let Some(b) = r.prefix_blocks.first() {
            by_first.entry(*b).or_default().push(r);
        }
    }
    let Some(group) = by_first
        .values()
        .filter(|g| g.len() > 1)
        .max_by_key(|g| g.len())
    else {
        return 0;
    };
    let shared = (0..)
        .take_while(|&i| {
            let b = group[0].prefix_blocks.get(i);
            b.is_some() && group.iter().all(|r| r.prefix_blocks.get(i) == b)
        })
        .count() as u32;
    // A block spans block_tokens; the last shared one may be partial.
    let bt = group[0].block_tokens.unwrap_or(0);
    let min_input = group.iter().map(|r| r.input_tokens).min().unwrap_or(0);
    (shared * bt).min(min_input)
}

/// `w` as a workload file (`envelope plan --workload` reads it back).
pub fn workload_toml(w: &Workload) -> String {
    toml::to_string(w).unwrap_or_default()
}
