//! Agent-shaped load (`load.workload`): the task classes of an `envelope
//! plan` workload, each a stream of runs arriving at its rate times a scale
//! factor (Poisson, on/off bursts, or a ramp). A run is a session of calls
//! made one after another: the first call's prompt is the class's shared
//! system prompt and the run's own tokens; each later call's prompt is the
//! previous prompt, that call's output and the tool results. Retries and
//! fallbacks are sent again at the workload's amplification. The sweep
//! searches the largest scale that meets the SLOs and keeps per-class
//! latencies.

use crate::config::AgentLoad;
use crate::load::{open_schedule, ProbeRun, ScheduledCall, StopWhen};
use crate::record::{Driver, LoadRequest, RequestRecord};
use envelope_profile::workload::TaskClass;
use envelope_profile::Percentiles;
use envelope_profile::{ClassSummary, Slo};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One call of a run, ready to send.
#[derive(Debug, Clone)]
pub struct PlannedCall {
    pub class: usize,
    pub request: LoadRequest,
}

/// A run: when it arrives (seconds from the probe start) and its calls.
#[derive(Debug, Clone)]
pub struct PlannedRun {
    pub at_s: f64,
    pub class: usize,
    pub calls: Vec<PlannedCall>,
}

/// A sample of a token count whose median and 95th percentile are given
/// (log-normal; the median where they are equal), at least 1.
fn tokens(rng: &mut impl Rng, p50: f64, p95: f64) -> u32 {
    let p50 = p50.max(1.0);
    let sigma = (p95.max(p50) / p50).ln() / 1.645;
    // Box-Muller from two uniforms in (0, 1].
    let (u1, u2): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    (p50 * (sigma * z).exp()).round().max(1.0) as u32
}

/// How many times a call is sent: once, plus one more with probability
/// `amplification - 1` for retries and again for fallbacks.
fn sends(rng: &mut impl Rng, c: &TaskClass) -> u32 {
    1 + u32::from(rng.random::<f64>() < c.retry_amplification - 1.0)
        + u32::from(rng.random::<f64>() < c.fallback_amplification - 1.0)
}

/// Seconds a probe at `scale` lasts: `duration_s`, or longer where that
/// would hold under `min_runs` runs on average.
pub fn probe_seconds(a: &AgentLoad, scale: f64) -> f64 {
    let runs_per_s: f64 = a
        .workload
        .classes
        .iter()
        .map(|c| c.runs_per_min * scale / 60.0)
        .sum();
    a.duration_s.max(a.min_runs as f64 / runs_per_s.max(1e-9))
}

/// The runs of one probe at `scale` over [`probe_seconds`], from `seed`:
/// the same arguments give the same runs.
pub fn plan_runs(a: &AgentLoad, scale: f64, vocab: usize, seed: u64) -> Vec<PlannedRun> {
    let a = &AgentLoad {
        duration_s: probe_seconds(a, scale),
        ..a.clone()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let vocab = vocab.max(2) as u32;
    let mut runs = vec![];
    for (ci, c) in a.workload.classes.iter().enumerate() {
        let rate = c.runs_per_min * scale / 60.0;
        if rate <= 0.0 {
            continue;
        }
        // The class's system prompt: the same ids in every run.
        let system: Vec<u32> = (0..c.system_prompt_tokens)
            .map(|i| 1 + (ci as u32 * 7919 + i * 31) % (vocab - 1))
            .collect();
        let (_, peak) = a.arrival.factor(0.0, a.duration_s);
        // Thinning: candidates at the peak rate, each kept with
        // probability rate(t) / peak.
        let mut t = 0.0;
        loop {
            t += -(1.0 - rng.random::<f64>()).ln() / (rate * peak);
            if t >= a.duration_s {
                break;
            }
            let (f, _) = a.arrival.factor(t, a.duration_s);
            if rng.random::<f64>() * peak >= f {
                continue;
            }
            let calls_f = c.model_calls_per_run.max(0.0);
            let n_calls = calls_f.floor() as u32 + u32::from(rng.random::<f64>() < calls_f.fract());
            let first_in = tokens(&mut rng, c.input_tokens_p50, c.input_tokens_p95)
                .max(c.system_prompt_tokens + 1);
            let mut prompt = system.clone();
            prompt.extend(
                (prompt.len() as u32..first_in).map(|_| 1 + rng.random_range(0..vocab - 1)),
            );
            let mut calls = vec![];
            for k in 0..n_calls {
                if k > 0 && c.session {
                    // The previous output and the tool results join the context.
                    let prev_out = calls
                        .last()
                        .map_or(0, |c: &PlannedCall| c.request.output_tokens);
                    let grow = prev_out + c.tool_result_tokens;
                    prompt.extend((0..grow).map(|_| 1 + rng.random_range(0..vocab - 1)));
                } else if k > 0 {
                    // An independent call: its own input over the system prompt.
                    let n = tokens(&mut rng, c.input_tokens_p50, c.input_tokens_p95)
                        .max(c.system_prompt_tokens + 1);
                    prompt.truncate(system.len());
                    prompt.extend(
                        (system.len() as u32..n).map(|_| 1 + rng.random_range(0..vocab - 1)),
                    );
                }
                let out = tokens(&mut rng, c.output_tokens_p50, c.output_tokens_p95);
                for _ in 0..sends(&mut rng, c) {
                    calls.push(PlannedCall {
                        class: ci,
                        request: LoadRequest {
                            prompt_tokens: prompt.clone(),
                            prompt_text: None,
                            output_tokens: out,
                        },
                    });
                }
            }
            if !calls.is_empty() {
                runs.push(PlannedRun {
                    at_s: t,
                    class: ci,
                    calls,
                });
            }
        }
    }
    runs.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    runs
}

/// Sends `runs` on their schedule (each run's calls in order, on its own
/// thread); the records carry their class and run. Stopped once
/// `stop_when` says so.
pub fn run_probe(
    driver: &Arc<dyn Driver>,
    a: &AgentLoad,
    runs: Vec<PlannedRun>,
    late_after_s: f64,
    stop_when: Option<StopWhen>,
) -> ProbeRun {
    let names: Vec<String> = a.workload.classes.iter().map(|c| c.name.clone()).collect();
    let sessions = runs
        .into_iter()
        .map(|r| {
            let class = names[r.class].clone();
            r.calls
                .into_iter()
                .map(|c| ScheduledCall {
                    // Each call after the first as soon as the one before ends.
                    due_s: r.at_s,
                    class: Some(class.clone()),
                    tenant: None,
                    request: c.request,
                })
                .collect()
        })
        .collect();
    open_schedule(driver, sessions, late_after_s, stop_when)
}

/// Overload at `from` for `a.duration_s`, then `to` for `a.recovery_s`
/// with no pause between them (the backlog is not drained first); returns
/// the records and the switch time.
pub fn overload_then(
    driver: &Arc<dyn Driver>,
    a: &AgentLoad,
    from: f64,
    to: f64,
    seed: u64,
    late_after_s: f64,
) -> (ProbeRun, f64) {
    let vocab = driver.vocab_size();
    let switch_s = probe_seconds(a, from);
    let mut runs = plan_runs(a, from, vocab, seed);
    let after = AgentLoad {
        duration_s: a.recovery_s,
        ..a.clone()
    };
    runs.extend(
        plan_runs(&after, to, vocab, seed ^ 0x5eed)
            .into_iter()
            .map(|mut r| {
                r.at_s += switch_s;
                r
            }),
    );
    runs.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
    (run_probe(driver, a, runs, late_after_s, None), switch_s)
}

/// Requests a tail must hold for the SLOs to be judged on it.
const MIN_TAIL: usize = 5;

/// Whether `recs` meet the SLOs as the sweep judges a probe: error rate,
/// TTFT p95, ITL p95 (over every gap) and e2e p99.
fn holds(recs: &[&RequestRecord], slo: &Slo) -> bool {
    let ok: Vec<&&RequestRecord> = recs.iter().filter(|r| r.error.is_none()).collect();
    let errors = (recs.len() - ok.len()) as f64 / recs.len().max(1) as f64;
    let ttft: Vec<f64> = ok
        .iter()
        .filter_map(|r| r.ttft_s.map(|t| t * 1e3))
        .collect();
    let itl: Vec<f64> = ok
        .iter()
        .flat_map(|r| r.itl_s.iter().map(|t| t * 1e3))
        .collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s * 1e3).collect();
    errors <= slo.max_error_rate
        && slo
            .ttft_p95_ms
            .is_none_or(|t| Percentiles::of(&ttft).p95 <= t)
        && slo
            .itl_p95_ms
            .is_none_or(|t| itl.is_empty() || Percentiles::of(&itl).p95 <= t)
        && slo
            .e2e_p99_ms
            .is_none_or(|t| Percentiles::of(&e2e).p99 <= t)
}

/// Whether one request alone missed an SLO: failed, or its TTFT, its own
/// ITL p95 or its e2e over the limit.
fn missed(r: &RequestRecord, slo: &Slo) -> bool {
    let itl: Vec<f64> = r.itl_s.iter().map(|t| t * 1e3).collect();
    r.error.is_some()
        || slo.e2e_p99_ms.is_some_and(|t| r.e2e_s * 1e3 > t)
        || slo
            .ttft_p95_ms
            .is_some_and(|t| r.ttft_s.is_none_or(|x| x * 1e3 > t))
        || slo
            .itl_p95_ms
            .is_some_and(|t| !itl.is_empty() && Percentiles::of(&itl).p95 > t)
}

/// After an overload that ended at `switch_s`: the recovery time, from the
/// switch to the earliest request from which on the requests meet the SLOs
/// again (judged as a probe is, over at least five requests); with the
/// requests started after the switch and those among them that missed an
/// SLO alone or failed.
pub fn recovery(run: &ProbeRun, switch_s: f64, slo: &Slo) -> (Option<f64>, u64, u64) {
    let mut after: Vec<&RequestRecord> = run
        .records
        .iter()
        .filter(|r| r.start_s >= switch_s)
        .collect();
    after.sort_by(|x, y| x.start_s.total_cmp(&y.start_s));
    let missed = after.iter().filter(|r| missed(r, slo)).count() as u64;
    let t = (0..after.len().saturating_sub(MIN_TAIL - 1))
        .find(|&i| holds(&after[i..], slo))
        .map(|i| {
            if i == 0 {
                0.0
            } else {
                after[i].start_s - switch_s
            }
        });
    (t, after.len() as u64, missed)
}

/// The knee of goodput against scale (`points` sorted by scale): the last
/// scale before goodput grows at under half its initial rate.
pub fn knee(points: &[(f64, f64)]) -> Option<f64> {
    let (s0, g0) = *points.first()?;
    if s0 <= 0.0 || g0 <= 0.0 {
        return None;
    }
    let slope0 = g0 / s0;
    points
        .windows(2)
        .find(|w| (w[1].1 - w[0].1) / (w[1].0 - w[0].0) < 0.5 * slope0)
        .map(|w| w[0].0)
}

/// Figures of some of a probe's records (a class's, a tenant's).
fn summary_of(recs: &[&RequestRecord]) -> ClassSummary {
    let ok: Vec<&&RequestRecord> = recs.iter().filter(|r| r.error.is_none()).collect();
    // A run's span: first call sent to last call answered.
    let mut spans: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for r in recs {
        let e = spans.entry(r.run).or_insert((f64::MAX, 0.0));
        e.0 = e.0.min(r.start_s);
        e.1 = e.1.max(r.start_s + r.e2e_s);
    }
    let ms = |v: f64| v * 1e3;
    ClassSummary {
        runs: spans.len() as u64,
        requests: recs.len() as u64,
        errors: (recs.len() - ok.len()) as u64,
        input_tokens_mean: if recs.is_empty() {
            0.0
        } else {
            recs.iter().map(|r| r.input_tokens as f64).sum::<f64>() / recs.len() as f64
        },
        ttft_ms: Percentiles::of(
            &ok.iter()
                .filter_map(|r| r.ttft_s.map(ms))
                .collect::<Vec<_>>(),
        ),
        itl_ms: Percentiles::of(
            &ok.iter()
                .flat_map(|r| r.itl_s.iter().map(|v| ms(*v)))
                .collect::<Vec<_>>(),
        ),
        e2e_ms: Percentiles::of(&ok.iter().map(|r| ms(r.e2e_s)).collect::<Vec<_>>()),
        run_e2e_ms: Percentiles::of(&spans.values().map(|(a, b)| ms(b - a)).collect::<Vec<_>>()),
    }
}

/// Per-class figures of a probe's records (every class of the workload,
/// those with no request too).
pub fn class_summaries(a: &AgentLoad, run: &ProbeRun) -> BTreeMap<String, ClassSummary> {
    a.workload
        .classes
        .iter()
        .map(|c| {
            let recs: Vec<&RequestRecord> = run
                .records
                .iter()
                .filter(|r| r.class.as_deref() == Some(c.name.as_str()))
                .collect();
            (c.name.clone(), summary_of(&recs))
        })
        .collect()
}

/// Figures of `records` grouped by `key` (records without one left out).
pub fn group_summaries<'a>(
    records: &'a [RequestRecord],
    key: impl Fn(&'a RequestRecord) -> Option<&'a str>,
) -> BTreeMap<String, ClassSummary> {
    let mut groups: BTreeMap<&str, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        if let Some(k) = key(r) {
            groups.entry(k).or_default().push(r);
        }
    }
    groups
        .into_iter()
        .map(|(k, recs)| (k.to_string(), summary_of(&recs)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arrival;
    use envelope_profile::workload::Workload;

    fn load(arrival: Arrival, calls: f64, tool: u32) -> AgentLoad {
        let text = format!(
            r#"
[[class]]
name = "plan"
runs_per_min = 600
model_calls_per_run = {calls}
input_tokens_p50 = 40
input_tokens_p95 = 60
output_tokens_p50 = 10
output_tokens_p95 = 10
system_prompt_tokens = 16
session = true
tool_result_tokens = {tool}

[[class]]
name = "classify"
runs_per_min = 1200
model_calls_per_run = 1
retry_amplification = 1.5
input_tokens_p50 = 20
input_tokens_p95 = 20
output_tokens_p50 = 4
output_tokens_p95 = 4
"#
        );
        AgentLoad {
            workload: Workload::from_toml(&text, "w.toml").unwrap(),
            arrival,
            scale_min: 0.5,
            scale_step: 0.5,
            scale_max: 4.0,
            duration_s: 20.0,
            collapse_probes: 3,
            collapse_fraction: 0.5,
            recovery_s: 40.0,
            min_runs: 1,
        }
    }

    #[test]
    fn sessions_grow_over_a_shared_system_prompt() {
        let a = load(Arrival::Poisson, 3.0, 7);
        let runs = plan_runs(&a, 1.0, 1000, 1);
        let plans: Vec<_> = runs.iter().filter(|r| r.class == 0).collect();
        assert!(!plans.is_empty());
        let system = &plans[0].calls[0].request.prompt_tokens[..16];
        for r in &plans {
            assert_eq!(r.calls.len(), 3, "3 calls, no retries in this class");
            for w in r.calls.windows(2) {
                let (a, b) = (&w[0].request, &w[1].request);
                // The next prompt is this prompt + its output + tool results.
                assert_eq!(
                    b.prompt_tokens.len(),
                    a.prompt_tokens.len() + a.output_tokens as usize + 7
                );
                assert_eq!(
                    &b.prompt_tokens[..a.prompt_tokens.len()],
                    &a.prompt_tokens[..]
                );
            }
            assert_eq!(&r.calls[0].request.prompt_tokens[..16], system);
        }
        // Without `session`, each call draws its own input over the system
        // prompt, as `envelope plan` counts calls.
        let mut flat = a.clone();
        flat.workload.classes[0].session = false;
        for r in plan_runs(&flat, 1.0, 1000, 1)
            .iter()
            .filter(|r| r.class == 0)
        {
            for c in &r.calls {
                assert_eq!(&c.request.prompt_tokens[..16], system);
            }
            let (p0, p1) = (
                &r.calls[0].request.prompt_tokens,
                &r.calls[1].request.prompt_tokens,
            );
            assert!(
                !p1.starts_with(p0),
                "the second call does not extend the first"
            );
        }
        // The same seed plans the same runs; another seed other runs.
        let again = plan_runs(&a, 1.0, 1000, 1);
        assert_eq!(again.len(), runs.len());
        assert_eq!(
            again[3].calls[0].request.prompt_tokens,
            runs[3].calls[0].request.prompt_tokens
        );
        assert_ne!(plan_runs(&a, 1.0, 1000, 2)[3].at_s, runs[3].at_s);
    }

    #[test]
    fn rates_scale_and_retries_amplify() {
        let a = load(Arrival::Poisson, 1.0, 0);
        let count = |scale: f64, class: usize| {
            plan_runs(&a, scale, 1000, 3)
                .iter()
                .filter(|r| r.class == class)
                .count() as f64
        };
        // 600/min for 20 s = 200 runs at scale 1; 400 at scale 2.
        assert!((count(1.0, 0) - 200.0).abs() < 45.0, "{}", count(1.0, 0));
        assert!((count(2.0, 0) - 400.0).abs() < 65.0, "{}", count(2.0, 0));
        let classify: Vec<_> = plan_runs(&a, 1.0, 1000, 3)
            .into_iter()
            .filter(|r| r.class == 1)
            .collect();
        let sent: usize = classify.iter().map(|r| r.calls.len()).sum();
        let ratio = sent as f64 / classify.len() as f64;
        assert!(
            (ratio - 1.5).abs() < 0.1,
            "retry amplification 1.5, got {ratio}"
        );
    }

    #[test]
    fn the_knee_is_where_goodput_stops_growing() {
        // Linear to 2, flat after.
        let pts = [
            (0.5, 5.0),
            (1.0, 10.0),
            (2.0, 20.0),
            (4.0, 21.0),
            (8.0, 4.0),
        ];
        assert_eq!(knee(&pts), Some(2.0));
        assert_eq!(knee(&pts[..3]), None);
    }

    #[test]
    fn recovery_is_timed_from_the_switch_until_the_slos_hold_again() {
        let slo = Slo {
            e2e_p99_ms: Some(1000.0),
            ..Slo::default()
        };
        let rec = |start_s: f64, e2e_s: f64| RequestRecord {
            start_s,
            e2e_s,
            ..Default::default()
        };
        // Before the switch at 10 s: ignored. After: slow until 12 s, then
        // five fast requests.
        let mut recs = vec![rec(9.0, 5.0), rec(10.5, 4.0), rec(11.5, 2.0)];
        recs.extend((0..5).map(|i| rec(12.0 + i as f64, 0.2)));
        let mut run = ProbeRun {
            records: recs,
            ..Default::default()
        };
        assert_eq!(recovery(&run, 10.0, &slo), (Some(2.0), 7, 2));
        // A slow one at the end: the tail's p99 breaks the SLO to the end.
        run.records.push(rec(17.0, 3.0));
        assert_eq!(recovery(&run, 10.0, &slo).0, None);
        // Fast from the switch on.
        run.records = (0..6).map(|i| rec(10.0 + i as f64, 0.1)).collect();
        assert_eq!(recovery(&run, 10.0, &slo), (Some(0.0), 6, 0));
        // Too few requests to judge.
        run.records.truncate(3);
        assert_eq!(recovery(&run, 10.0, &slo).0, None);
        // Slow between tokens until 12 s: ITL counts too.
        let slo = Slo {
            itl_p95_ms: Some(100.0),
            ..slo
        };
        let gaps = |ms: f64, start_s: f64| RequestRecord {
            start_s,
            e2e_s: 0.5,
            itl_s: vec![ms / 1e3; 4],
            ..Default::default()
        };
        run.records = vec![gaps(400.0, 10.2), gaps(300.0, 11.0)];
        run.records
            .extend((0..5).map(|i| gaps(20.0, 12.0 + i as f64)));
        assert_eq!(recovery(&run, 10.0, &slo), (Some(2.0), 7, 2));
    }

    #[test]
    fn bursts_leave_the_off_phases_empty_and_ramps_rise() {
        let a = load(
            Arrival::Bursts {
                on_s: 1.0,
                off_s: 3.0,
            },
            1.0,
            0,
        );
        let runs = plan_runs(&a, 1.0, 1000, 4);
        assert!(runs.iter().all(|r| r.at_s % 4.0 < 1.0));
        // Same mean: about 200 + 400 runs in 20 s.
        assert!((runs.len() as f64 - 600.0).abs() < 90.0, "{}", runs.len());
        let a = load(Arrival::Ramp, 1.0, 0);
        let runs = plan_runs(&a, 1.0, 1000, 5);
        let first = runs.iter().filter(|r| r.at_s < 10.0).count();
        let second = runs.len() - first;
        // Linear from 0: a quarter of the runs in the first half.
        assert!(second > 2 * first, "{first} then {second}");
    }
}
