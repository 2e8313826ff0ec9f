//! `envelope plan --tier NAME=PROFILE ...`: the workload split by the
//! share of its model requests each tier serves, each part planned with
//! its tier's profile, and replicas per tier side by side.

use super::PlanArgs;
use anyhow::{Context, Result};
use envelope_profile::plan::render::render;
use envelope_profile::plan::tiers::{mix_from_trace, tier_workload, tiers_named};
use envelope_profile::trace::Trace;
use envelope_profile::workload::Workload;
use envelope_profile::Profile;
use std::collections::BTreeMap;

fn parse_mix(text: &str) -> Result<BTreeMap<String, f64>> {
    text.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (name, share) = p
                .split_once('=')
                .with_context(|| format!("--tier-mix: `{p}` is not NAME=SHARE"))?;
            let share: f64 = share
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| s.is_finite() && *s >= 0.0)
                .with_context(|| format!("--tier-mix: `{p}`: the share must be a number >= 0"))?;
            Ok((name.trim().to_string(), share))
        })
        .collect()
}

pub fn run(args: &PlanArgs, workload: &Workload, wpath: &str) -> Result<()> {
    let mut profiles = BTreeMap::new();
    for t in &args.tier {
        let (name, path) = t
            .split_once('=')
            .with_context(|| format!("--tier: `{t}` is not NAME=PROFILE"))?;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --tier {name}={path}"))?;
        profiles.insert(
            name.to_string(),
            (path.to_string(), Profile::from_json(&text, path)?),
        );
    }
    let mix = match (&args.tier_mix, &args.tier_mix_from) {
        (Some(m), _) => parse_mix(m)?,
        (None, Some(p)) => {
            let trace = Trace::read(&p.display().to_string(), None)
                .map_err(|e| anyhow::anyhow!("--tier-mix-from {e}"))?;
            mix_from_trace(&trace)
                .map_err(|e| anyhow::anyhow!("--tier-mix-from {}: {e}", p.display()))?
        }
        (None, None) => BTreeMap::new(),
    };
    for t in tiers_named(workload, &mix) {
        if !profiles.contains_key(&t) {
            anyhow::bail!("tier `{t}` has a share but no --tier {t}=PROFILE");
        }
    }
    let mut plans = vec![];
    for (name, (ppath, profile)) in &profiles {
        let Some(w) = tier_workload(workload, name, &mix) else {
            eprintln!("tier {name}: no share of {wpath}; not planned");
            continue;
        };
        let plan = envelope_profile::plan::plan(&w, profile, args.config.as_deref())
            .with_context(|| format!("planning tier {name} on {ppath}"))?;
        plans.push((name.clone(), ppath.clone(), w, plan));
    }
    if plans.is_empty() {
        anyhow::bail!(
            "no tier has a share of the workload: give the classes `tiers`, or --tier-mix"
        );
    }
    if args.json {
        let v: Vec<_> = plans
            .iter()
            .map(|(n, p, w, plan)| {
                serde_json::json!({"tier": n, "profile": p, "workload": w, "plan": plan})
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"mix": mix, "tiers": v}))?
        );
        return Ok(());
    }
    println!("== replicas per tier ({wpath})");
    let scenarios: Vec<&str> = plans[0]
        .3
        .scenarios
        .iter()
        .map(|s| s.scenario.as_str())
        .collect();
    println!("tier | model requests/min | {}", scenarios.join(" | "));
    for (name, _, _, plan) in &plans {
        let rpm: f64 = plan.demand.iter().map(|d| d.model_requests_per_min).sum();
        let reps: Vec<String> = plan
            .scenarios
            .iter()
            .map(|s| s.replicas.to_string())
            .collect();
        println!("{name} | {rpm:.2} | {}", reps.join(" | "));
    }
    for (name, ppath, _, plan) in &plans {
        println!("\n== tier {name}");
        print!("{}", render(plan, &format!("{wpath} @ {name}"), ppath));
    }
    Ok(())
}
