//! `envelope plan --validate`: a capacity plan checked by replay. The
//! workload is sent, at one replica's planned share of a scenario's
//! arrivals, to a server like the profiled one; per plan constraint the
//! utilisation the plan predicted for that replica is set against the one
//! measured (Little's law on the replay's own requests: slots = sum of e2e
//! / window; token rates = tokens / window; KV = sum of (input + output) x
//! e2e / window, each divided by the profile's per-replica supply), and the
//! SLOs are judged as a probe's are. A plan is optimistic when a measured
//! utilisation exceeds the predicted one by more than the tolerance, or when
//! the share breaks an SLO.

use crate::agents::{plan_runs, run_probe};
use crate::check::check_server;
use crate::config::LoadConfig;
use crate::config::{AgentLoad, Arrival};
use crate::driver::{HttpDriver, HttpSettings, PromptFormat};
use crate::load::open_schedule;
use crate::record::{Driver, RequestRecord};
use crate::sweep::summarise;
use crate::trace_load::TraceLoad;
use envelope_profile::plan::{Plan, PlanConstraint};
use envelope_profile::trace::Trace;
use envelope_profile::workload::Workload;
use envelope_profile::{ProbeSummary, Slo};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// Where and how long to replay.
#[derive(Debug, Clone)]
pub struct ReplaySettings {
    pub base_url: String,
    /// The model name sent in requests.
    pub model: String,
    pub vocab_size: usize,
    /// `base` (mean arrivals) or `planned_peak` (p95 arrivals).
    pub scenario: String,
    pub seconds: f64,
    /// Allowed excess of measured over predicted utilisation (0.15 = 15%).
    pub tolerance: f64,
    pub seed: u64,
}

/// One plan constraint, predicted against measured.
#[derive(Debug, Clone, Serialize)]
pub struct ConstraintCheck {
    pub constraint: String,
    pub unit: String,
    /// Demand on the replica: planned (the scenario's / replicas) and measured.
    pub demand_predicted: f64,
    pub demand_measured: f64,
    pub utilisation_predicted: f64,
    pub utilisation_measured: f64,
    pub optimistic: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Validation {
    pub scenario: String,
    pub replicas: u64,
    pub seconds: f64,
    pub tolerance: f64,
    /// The replay's own sampling error, added to the tolerance: two
    /// standard errors of a Poisson count of the requests replayed
    /// (2 / sqrt(n)), so a short replay's draw is not taken for a wrong plan.
    pub sampling: f64,
    pub summary: ProbeSummary,
    pub checks: Vec<ConstraintCheck>,
    /// SLOs the replayed share broke.
    pub slo_breaches: Vec<String>,
    /// The share of prompt tokens the server found in its prefix cache
    /// over the replay (its counters, or its answers' `cached_tokens`);
    /// `None` where it told neither.
    pub prefix_cache_hit_rate: Option<f64>,
    pub optimistic: bool,
}

impl Validation {
    /// The replay against the plan as text: what was replayed, a row per
    /// constraint (planned and measured), the SLOs at the share and the
    /// verdict.
    pub fn table(&self, plan: &Plan, target: &str) -> String {
        use envelope_profile::plan::render::f;
        use std::fmt::Write;
        let mut o = String::new();
        let s = &self.summary;
        let _ = writeln!(
            o,
            "replayed `{}` at one replica's share of `{}` ({} replicas planned) for {:.0} s against {target}: {} requests, {} errors",
            plan.workload, self.scenario, self.replicas, self.seconds, s.requests, s.errors
        );
        o.push_str("| constraint | unit | demand planned | demand measured | utilisation planned | utilisation measured | verdict |\n");
        o.push_str("|---|---|---|---|---|---|---|\n");
        for c in &self.checks {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {:.3} | {:.3} | {} |",
                c.constraint,
                c.unit,
                f(c.demand_predicted),
                f(c.demand_measured),
                c.utilisation_predicted,
                c.utilisation_measured,
                if c.optimistic { "OPTIMISTIC" } else { "ok" }
            );
        }
        let slos = if self.slo_breaches.is_empty() {
            "held".to_string()
        } else {
            format!("broken: {}", self.slo_breaches.join(", "))
        };
        let _ = writeln!(
            o,
            "SLOs at the planned share: {slos} (TTFT p95 {:.0} ms, e2e p99 {:.0} ms)",
            s.ttft_ms.p95, s.e2e_ms.p99
        );
        let planned = |g: &dyn Fn(&envelope_profile::plan::ClassDemand) -> f64| {
            plan.demand
                .iter()
                .map(|d| format!("{} {:.2}", d.class, g(d)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            o,
            "prefix-cache hit rate seen: {} (planned: {}; floor: {}); prefill is measured on the tokens the server computed",
            self.prefix_cache_hit_rate
                .map_or("not reported by the server".into(), |h| format!("{h:.2}")),
            planned(&|d| d.cache_hit_rate),
            planned(&|d| d.cache_hit_rate_floor)
        );
        let _ = writeln!(
            o,
            "plan {} (tolerance {:.0}% + the replay's sampling error {:.0}%, from {} requests)",
            if self.optimistic {
                "OPTIMISTIC"
            } else {
                "confirmed"
            },
            self.tolerance * 100.0,
            self.sampling * 100.0,
            s.requests - s.errors
        );
        o
    }
}

/// The workload at one replica's share of `scenario`: each class's run rate
/// (mean, or p95 for `planned_peak`) divided by the scenario's replicas.
fn share(workload: &Workload, scenario: &str, replicas: u64) -> Result<Workload, String> {
    let mut w = workload.clone();
    for c in &mut w.classes {
        let rate = match scenario {
            "base" => c.runs_per_min,
            "planned_peak" => c.runs_per_min_p95.unwrap_or(c.runs_per_min),
            other => {
                return Err(format!(
                    "--scenario `{other}` cannot be replayed (base or planned_peak)"
                ))
            }
        };
        c.runs_per_min = rate / replicas.max(1) as f64;
        c.runs_per_min_p95 = None;
    }
    Ok(w)
}

/// Replays `workload` at one replica's share of `s.scenario` in `plan`
/// against `s.base_url` and compares. With `trace`, the trace itself is
/// replayed for `s.seconds` (its arrivals time-scaled to the share: the
/// share's runs a minute over the workload's), its classes matched to the
/// plan's as `--workload-from` names them (feature, else class, else
/// `default`).
pub fn validate(
    workload: &Workload,
    plan: &Plan,
    slo: &Slo,
    s: &ReplaySettings,
    trace: Option<&Trace>,
) -> Result<Validation, String> {
    let sc = plan
        .scenarios
        .iter()
        .find(|x| x.scenario == s.scenario)
        .ok_or_else(|| format!("the plan has no scenario `{}`", s.scenario))?;
    let mut driver = HttpDriver::new(HttpSettings {
        base_url: s.base_url.clone(),
        model: s.model.clone(),
        metrics_url: Some(format!("{}/metrics", s.base_url.trim_end_matches('/'))),
        vocab_size: s.vocab_size,
        prompt_format: PromptFormat::Tokens,
        extra_body: Default::default(),
        request_timeout: Duration::from_secs(600),
    })?;
    check_server(&mut driver, None).map_err(|e| format!("server check failed: {e}"))?;
    let load = AgentLoad {
        workload: share(workload, &s.scenario, sc.replicas)?,
        arrival: Arrival::Poisson,
        scale_min: 1.0,
        scale_step: 1.0,
        scale_max: 1.0,
        duration_s: s.seconds,
        collapse_probes: 0,
        collapse_fraction: 0.5,
        recovery_s: s.seconds,
        min_runs: 1,
    };
    let driver: Arc<dyn Driver> = Arc::new(driver);
    let run = match trace {
        None => {
            let runs = plan_runs(&load, 1.0, s.vocab_size, s.seed);
            run_probe(&driver, &load, runs, 0.5, None)
        }
        Some(t) => {
            let rate = |w: &Workload| w.classes.iter().map(|c| c.runs_per_min).sum::<f64>();
            let scale = rate(&load.workload) / rate(workload).max(1e-9);
            // Classes as the derived workload names them: by feature,
            // else by the trace's class.
            let mut trace = t.clone();
            for r in &mut trace.requests {
                r.class = r.feature.clone().or(r.class.take());
            }
            let replay = TraceLoad {
                trace,
                scale_min: scale,
                scale_step: scale,
                scale_max: scale,
                window_s: Some(s.seconds),
                collapse_probes: 0,
                collapse_fraction: 0.5,
                recovery_s: s.seconds,
            };
            let sessions = replay.sessions(scale, 0.0, s.seconds, s.vocab_size);
            let mut run = open_schedule(&driver, sessions, 0.5, None);
            for r in &mut run.records {
                r.class.get_or_insert_with(|| "default".into());
            }
            run
        }
    };
    let summary = summarise(&run, run.max_in_flight, slo, &LoadConfig::default());
    let prefix_cache_hit_rate = summary.prefix_cache_hit_rate;
    let hits = prefix_cache_hit_rate.unwrap_or(0.0);
    let window = s.seconds;
    let served = run.records.iter().filter(|r| r.error.is_none()).count();
    let sampling = 2.0 / (served.max(1) as f64).sqrt();
    let mut checks = vec![];
    for need in &sc.constraints {
        let c = need.constraint;
        // The measured demand of each class over its per-replica supply.
        let (mut demand, mut util) = (0.0, 0.0);
        for sup in &plan.supply {
            let recs: Vec<&RequestRecord> = run
                .records
                .iter()
                .filter(|r| r.class.as_deref() == Some(sup.class.as_str()) && r.error.is_none())
                .collect();
            let d = match c {
                PlanConstraint::ConcurrencySlots => {
                    recs.iter().map(|r| r.e2e_s).sum::<f64>() / window
                }
                PlanConstraint::OutputTokPerS => {
                    recs.iter().map(|r| r.output_tokens as f64).sum::<f64>() / window
                }
                // The tokens the server computed: less what it found
                // cached, by its answers' word or its counters' rate.
                PlanConstraint::PrefillTokPerS => {
                    recs.iter()
                        .map(|r| match r.cached_tokens {
                            Some(c) => f64::from(r.input_tokens.saturating_sub(c)),
                            None => f64::from(r.input_tokens) * (1.0 - hits),
                        })
                        .sum::<f64>()
                        / window
                }
                PlanConstraint::KvTokens => {
                    recs.iter()
                        .map(|r| (r.input_tokens + r.output_tokens) as f64 * r.e2e_s)
                        .sum::<f64>()
                        / window
                }
            };
            let per = match c {
                PlanConstraint::ConcurrencySlots => sup.safe_concurrency_per_replica,
                PlanConstraint::OutputTokPerS => sup.output_tok_per_s_per_replica,
                PlanConstraint::PrefillTokPerS => sup.prefill_tok_per_s_per_replica,
                PlanConstraint::KvTokens => sup.kv_tokens_per_replica,
            };
            demand += d;
            if d > 0.0 {
                util += if per > 0.0 { d / per } else { f64::INFINITY };
            }
        }
        let predicted = need.replicas_exact / sc.replicas.max(1) as f64;
        checks.push(ConstraintCheck {
            constraint: c.as_str().into(),
            unit: c.unit().into(),
            demand_predicted: need.demand / sc.replicas.max(1) as f64,
            demand_measured: demand,
            utilisation_predicted: predicted,
            utilisation_measured: util,
            optimistic: util > predicted * (1.0 + s.tolerance + sampling),
        });
    }
    let slo_breaches: Vec<String> = summary
        .breaches
        .iter()
        .map(|b| b.as_str().to_string())
        .collect();
    let optimistic = checks.iter().any(|c| c.optimistic) || !slo_breaches.is_empty();
    Ok(Validation {
        scenario: s.scenario.clone(),
        replicas: sc.replicas,
        seconds: window,
        tolerance: s.tolerance,
        sampling,
        summary,
        checks,
        slo_breaches,
        prefix_cache_hit_rate,
        optimistic,
    })
}
