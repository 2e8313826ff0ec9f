//! The search over a scaled load after the buckets: an agent workload
//! (`load.workload`, runs per class at a multiple of their rates) or a
//! replayed trace (`[load.trace]`, its arrivals at a time-scale factor).
//! Both are searched as a bucket's levels are ([`LevelSearch`]): screens
//! stopped by a decided breach, the bracket's ends decided at
//! `slo.confidence` by replaying more of the load, an undecided level
//! never passed. Past the breach, probes at twice the scale run to the
//! collapse, and the recovery from there to the safe scale is timed.

use super::rows::push_rows;
use super::session::Session;
use super::summary::{level_verdict, max_requests, requests_to_hold, stop_when_decided, summarise};
use super::{Ctx, SweepEvent};
use crate::agents;
use crate::config::AgentLoad;
use crate::load::{open_schedule, ProbeRun, StopWhen};
use crate::record::{Driver, RequestRecord};
use crate::trace_load::TraceLoad;
use envelope_profile::{
    ClassSummary, Constraint, LevelSearch, LevelStep, LevelVerdict, Recovery, WorkloadProbe,
    WorkloadResult,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Figures per class, and per tenant (empty where the load has none).
type Groups = (
    BTreeMap<String, ClassSummary>,
    BTreeMap<String, ClassSummary>,
);

/// A load whose rate the sweep scales.
pub(super) trait ScaledLoad {
    /// `workload:NAME` or `trace:NAME` (the probes' bucket column).
    fn label(&self) -> String;
    fn name(&self) -> String;
    /// How requests arrive: `poisson`, `bursts`, `ramp` or `trace`.
    fn arrival(&self) -> String;
    /// The searched levels: scale = level x step.
    fn ladder(&self) -> (u32, u32);
    fn step(&self) -> f64;
    /// Probes past the breach, and the collapse's share of peak goodput.
    fn collapse(&self) -> (u32, f64);
    /// Parts `part..part + parts` of a level's load at `scale`, in one
    /// run without a break (part 0 is its screen; each later part new
    /// requests that follow on, as long as a screen), from `seed`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        driver: &Arc<dyn Driver>,
        scale: f64,
        part: u32,
        parts: u32,
        seed: u64,
        late_s: f64,
        stop: Option<StopWhen>,
    ) -> ProbeRun;
    /// The load at `from`, then at `to` with no pause; the switch time.
    fn overload_then(
        &self,
        driver: &Arc<dyn Driver>,
        from: f64,
        to: f64,
        seed: u64,
        late_s: f64,
    ) -> (ProbeRun, f64);
    /// Seconds at the safe scale after the overload.
    fn recovery_s(&self) -> f64;
    /// Per class (and for a trace, per tenant) figures of a run.
    fn groups(&self, run: &ProbeRun) -> Groups;
}

impl ScaledLoad for AgentLoad {
    fn label(&self) -> String {
        format!("workload:{}", self.workload.name)
    }
    fn name(&self) -> String {
        self.workload.name.clone()
    }
    fn arrival(&self) -> String {
        self.arrival.label().into()
    }
    fn ladder(&self) -> (u32, u32) {
        AgentLoad::ladder(self)
    }
    fn step(&self) -> f64 {
        self.scale_step
    }
    fn collapse(&self) -> (u32, f64) {
        (self.collapse_probes, self.collapse_fraction)
    }
    fn run(
        &self,
        driver: &Arc<dyn Driver>,
        scale: f64,
        part: u32,
        parts: u32,
        seed: u64,
        late_s: f64,
        stop: Option<StopWhen>,
    ) -> ProbeRun {
        let longer = AgentLoad {
            duration_s: agents::probe_seconds(self, scale) * f64::from(parts.max(1)),
            ..self.clone()
        };
        let runs = agents::plan_runs(
            &longer,
            scale,
            driver.vocab_size(),
            seed ^ (u64::from(part) << 40),
        );
        agents::run_probe(driver, self, runs, late_s, stop)
    }
    fn overload_then(
        &self,
        driver: &Arc<dyn Driver>,
        from: f64,
        to: f64,
        seed: u64,
        late_s: f64,
    ) -> (ProbeRun, f64) {
        agents::overload_then(driver, self, from, to, seed, late_s)
    }
    fn recovery_s(&self) -> f64 {
        self.recovery_s
    }
    fn groups(&self, run: &ProbeRun) -> Groups {
        (agents::class_summaries(self, run), BTreeMap::new())
    }
}

impl ScaledLoad for TraceLoad {
    fn label(&self) -> String {
        format!("trace:{}", self.trace.name)
    }
    fn name(&self) -> String {
        self.trace.name.clone()
    }
    fn arrival(&self) -> String {
        "trace".into()
    }
    fn ladder(&self) -> (u32, u32) {
        TraceLoad::ladder(self)
    }
    fn step(&self) -> f64 {
        self.scale_step
    }
    fn collapse(&self) -> (u32, f64) {
        (self.collapse_probes, self.collapse_fraction)
    }
    fn run(
        &self,
        driver: &Arc<dyn Driver>,
        scale: f64,
        part: u32,
        parts: u32,
        _seed: u64,
        late_s: f64,
        stop: Option<StopWhen>,
    ) -> ProbeRun {
        // Part n replays the n-th window of the trace (laps past its end).
        let secs = self.probe_seconds(scale);
        let from = f64::from(part) * secs * scale;
        let sessions = self.sessions(
            scale,
            from,
            secs * f64::from(parts.max(1)),
            driver.vocab_size(),
        );
        open_schedule(driver, sessions, late_s, stop)
    }
    fn overload_then(
        &self,
        driver: &Arc<dyn Driver>,
        from: f64,
        to: f64,
        _seed: u64,
        late_s: f64,
    ) -> (ProbeRun, f64) {
        let vocab = driver.vocab_size();
        let switch_s = self.probe_seconds(from);
        let mut sessions = self.sessions(from, 0.0, switch_s, vocab);
        // Then on through the trace at the safe factor, from where the
        // overload left it.
        let after = self.sessions(to, switch_s * from, self.recovery_s, vocab);
        sessions.extend(after.into_iter().map(|mut s| {
            for c in &mut s {
                c.due_s += switch_s;
            }
            s
        }));
        (open_schedule(driver, sessions, late_s, None), switch_s)
    }
    fn recovery_s(&self) -> f64 {
        self.recovery_s
    }
    fn groups(&self, run: &ProbeRun) -> Groups {
        (
            agents::group_summaries(&run.records, |r| r.class.as_deref()),
            agents::group_summaries(&run.records, |r| r.tenant.as_deref()),
        )
    }
}

/// Parts one run of a decision may take (a load too thin to decide a
/// level in this many screens' worth leaves it undecided).
const MAX_PARTS: u32 = 16;

/// The largest scale of `load` that meets every SLO at `slo.confidence`,
/// on the configuration's open session.
pub(super) fn search_scaled(
    ctx: &mut Ctx,
    session: &mut Session,
    load: &dyn ScaledLoad,
    name: &str,
    progress: &mut dyn FnMut(SweepEvent),
) -> WorkloadResult {
    let cfg = ctx.cfg;
    let label = load.label();
    let (lo, hi) = load.ladder();
    let step = load.step();
    let late_s = cfg.load.late_after_ms / 1e3;
    let budget = max_requests(&cfg.load, &cfg.slo, 1);
    let mut search = LevelSearch::new(lo, hi);
    let mut probes: Vec<(u32, WorkloadProbe)> = vec![];
    // Per level: its probe id, its records so far, and the next part.
    let mut runs: HashMap<u32, (u32, ProbeRun, u32)> = HashMap::new();
    // One probe at level `k`: its screen, or its extension until decided.
    let mut probe = |ctx: &mut Ctx, session: &mut Session, k: u32, extending: bool| {
        let scale = k as f64 * step;
        let before = if extending { runs.remove(&k) } else { None };
        let seed = ctx.probes_total as u64;
        let (run, next_part) = match &before {
            None => {
                progress(SweepEvent::Probing(&format!(
                    "{name} {label}: probing scale {scale:.2}"
                )));
                // A decided breach stops a screen; a hold does not (the
                // KV cache only shows under the whole load).
                let stop = stop_when_decided(&cfg.slo, vec![], usize::MAX);
                let r = load.run(&session.driver, scale, 0, 1, seed, late_s, Some(stop));
                (r, 1)
            }
            Some((_, prior, next)) => {
                progress(SweepEvent::Probing(&format!(
                    "{name} {label}: deciding scale {scale:.2} (up to {} more requests)",
                    budget.saturating_sub(prior.records.len() as u32)
                )));
                // As a bucket's level is decided: first the fewest more
                // requests that would decide it if none were over a limit,
                // then on to the budget; each in one run, in parts as long
                // as the screen.
                let per_part = prior.records.len().max(1) as u32;
                let out = (prior
                    .records
                    .iter()
                    .map(|r| u64::from(r.output_tokens))
                    .sum::<u64>()
                    / prior.records.len().max(1) as u64) as u32;
                let mut new = ProbeRun::default();
                let mut part = *next;
                for chunk_no in 1..=2 {
                    let mut seen: Vec<RequestRecord> = prior.records.clone();
                    seen.extend(new.records.iter().cloned());
                    let left = budget.saturating_sub(seen.len() as u32);
                    if left == 0 || stop_when_decided(&cfg.slo, vec![], 0)(&seen) {
                        break;
                    }
                    let Some(need) = requests_to_hold(&seen, &cfg.slo, out.max(1)) else {
                        break;
                    };
                    let n = if chunk_no == 1 {
                        need.max(1).min(left)
                    } else {
                        left
                    };
                    let parts = n.div_ceil(per_part).clamp(1, MAX_PARTS);
                    let stop = stop_when_decided(&cfg.slo, seen, 0);
                    let r = load.run(
                        &session.driver,
                        scale,
                        part,
                        parts,
                        seed,
                        late_s,
                        Some(stop),
                    );
                    part += parts;
                    new = if new.records.is_empty() {
                        r
                    } else {
                        new.extended(r)
                    };
                }
                (new, part)
            }
        };
        let probe_id = ctx.probes_total;
        ctx.probes_total += 1;
        let extends = before.as_ref().map(|(id, _, _)| *id);
        let this_probe = run.clone();
        let whole = match before {
            Some((_, r, _)) => r.extended(run),
            None => run,
        };
        let mut s = summarise(&whole, whole.max_in_flight, &cfg.slo, &cfg.load);
        if let Some(c) = session.died() {
            s.breaches.insert(0, c);
        }
        let verdict = level_verdict(&s, extending);
        if verdict == LevelVerdict::Undecided {
            s.breaches.insert(0, Constraint::Undecided);
        }
        push_rows(ctx, name, &label, (probe_id, extends), k, &this_probe, &s);
        progress(SweepEvent::Probed(ctx.probes.last().expect("just pushed")));
        let (classes, tenants) = load.groups(&whole);
        runs.insert(k, (extends.unwrap_or(probe_id), whole, next_part));
        (
            verdict,
            WorkloadProbe {
                scale,
                summary: s,
                classes,
                tenants,
            },
        )
    };
    loop {
        let (k, extending) = match search.next() {
            LevelStep::Screen(k) => (k, false),
            LevelStep::Decide(k) => (k, true),
            LevelStep::Done => break,
        };
        let (verdict, p) = probe(ctx, session, k, extending);
        search.record(k, verdict);
        match probes.iter_mut().find(|(l, _)| *l == k) {
            Some(slot) => slot.1 = p,
            None => probes.push((k, p)),
        }
    }
    // Past the breach, to the collapse: goodput under a fraction of its peak.
    let (collapse_probes, collapse_fraction) = load.collapse();
    let peak = |probes: &[(u32, WorkloadProbe)]| {
        probes
            .iter()
            .map(|(_, p)| p.summary.goodput_req_per_s)
            .fold(0.0, f64::max)
    };
    let goodput_at = |probes: &[(u32, WorkloadProbe)], k: u32| {
        probes
            .iter()
            .find(|(j, _)| *j == k)
            .map(|(_, p)| p.summary.goodput_req_per_s)
    };
    let mut collapse = None;
    if let Some(mut k) = search.infeasible() {
        for _ in 0..collapse_probes {
            if goodput_at(&probes, k).is_some_and(|g| g < collapse_fraction * peak(&probes)) {
                collapse = Some(k);
                break;
            }
            k *= 2;
            if probes.iter().all(|(j, _)| *j != k) {
                let (_, p) = probe(ctx, session, k, false);
                probes.push((k, p));
            }
        }
        if collapse.is_none()
            && goodput_at(&probes, k).is_some_and(|g| g < collapse_fraction * peak(&probes))
        {
            collapse = Some(k);
        }
    }
    let feasible = search.feasible().map_or(0.0, |k| k as f64 * step);
    let safe = feasible * (1.0 - cfg.slo.headroom);
    // Recovery: from the collapse (or the highest probe) straight to the
    // safe scale.
    let recovery = match (search.infeasible(), collapse_probes) {
        (Some(_), n) if n > 0 && safe > 0.0 => {
            let from_k =
                collapse.unwrap_or_else(|| probes.iter().map(|(k, _)| *k).max().unwrap_or(hi));
            let from = from_k as f64 * step;
            progress(SweepEvent::Probing(&format!(
                "{name} {label}: recovery from scale {from:.2} to {safe:.2}"
            )));
            let (run, switch_s) =
                load.overload_then(&session.driver, from, safe, ctx.probes_total as u64, late_s);
            let (recovery_s, requests_after, missed_after) =
                agents::recovery(&run, switch_s, &cfg.slo);
            Some(Recovery {
                from_scale: from,
                to_scale: safe,
                overload_s: switch_s,
                window_s: load.recovery_s(),
                recovery_s,
                requests_after,
                missed_after,
            })
        }
        _ => None,
    };
    let binding = match search.infeasible() {
        Some(i) => probes
            .iter()
            .find(|(k, _)| *k == i)
            .and_then(|(_, p)| p.summary.breaches.first().copied())
            .unwrap_or(Constraint::Errors),
        None => Constraint::SearchCap,
    };
    probes.sort_by_key(|(k, _)| *k);
    let curve: Vec<(f64, f64)> = probes
        .iter()
        .map(|(_, p)| (p.scale, p.summary.goodput_req_per_s))
        .collect();
    WorkloadResult {
        name: load.name(),
        arrival: load.arrival(),
        feasible_scale: feasible,
        feasible_upper_scale: search.upper().map(|k| k as f64 * step),
        safe_scale: safe,
        binding_constraint: binding,
        knee_scale: agents::knee(&curve),
        collapse_scale: collapse.map(|k| k as f64 * step),
        recovery,
        probes: probes.into_iter().map(|(_, p)| p).collect(),
    }
}
