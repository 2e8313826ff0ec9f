//! `envelope plan`: a workload's demand against a profile's measured supply,
//! printed with every intermediate value and its unit (or as JSON).

mod tiers;

use anyhow::{Context, Result};
use clap::Args;
use envelope_profile::plan::render::render;
use envelope_profile::plan::Plan;
use envelope_profile::trace::{workload_from_trace, workload_toml, Trace};
use envelope_profile::workload::Workload;
use envelope_profile::Profile;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The workload (TOML; see bench-configs/workloads/README.md).
    #[arg(
        long,
        env = "ENVELOPE_PLAN_WORKLOAD",
        required_unless_present = "workload_from",
        conflicts_with = "workload_from"
    )]
    pub workload: Option<PathBuf>,
    /// Derive the workload from a trace instead (ours as `envelope govern
    /// --record` writes it, Mooncake's JSON lines or BurstGPT's CSV): a
    /// class per trace class, a run per session, rates, token percentiles
    /// and burstiness measured. The derived workload's TOML is printed
    /// first (to stderr with --json).
    #[arg(long, value_name = "TRACE")]
    pub workload_from: Option<PathBuf>,
    /// A profile written by `envelope sweep` (the supply side).
    #[arg(long, env = "ENVELOPE_PLAN_PROFILE", required_unless_present = "tier")]
    pub profile: Option<PathBuf>,
    /// Model tiers: a tier and its profile, `NAME=PROFILE` (repeat per
    /// tier). Each tier is planned with its own profile for its share of
    /// the workload's model requests (the classes' `tiers`, else --tier-mix
    /// or --tier-mix-from).
    #[arg(long, value_name = "NAME=PROFILE", conflicts_with_all = ["profile", "validate"])]
    pub tier: Vec<String>,
    /// Model tiers: requests per call on each tier, `small=0.8,large=0.25`.
    #[arg(long, value_name = "NAME=SHARE,...", conflicts_with = "tier_mix_from")]
    pub tier_mix: Option<String>,
    /// Model tiers: the mix measured by the governor, from the trace it
    /// recorded (`envelope govern --tiers FILE --record TRACE`: attempts
    /// per call on each tier).
    #[arg(long, value_name = "TRACE.jsonl")]
    pub tier_mix_from: Option<PathBuf>,
    /// The profile configuration to plan with (default: the profile's `selected`).
    #[arg(long, env = "ENVELOPE_PLAN_CONFIG")]
    pub config: Option<String>,
    /// Print the plan as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Check the plan by replay: send the workload, at one replica's share
    /// of the scenario's arrivals, to --target (a server like the profiled
    /// one) and compare each constraint's predicted utilisation with the
    /// measured one; exit 1 when the plan was optimistic beyond
    /// --tolerance or the share broke an SLO.
    #[arg(long, requires = "target")]
    pub validate: bool,
    /// --validate: the server's base URL (loopback or a host you own).
    #[arg(long)]
    pub target: Option<String>,
    /// --validate: replay this trace (its arrivals at one replica's share
    /// of the scenario, sessions in order) instead of synthetic runs of
    /// the workload; with --workload-from, the trace it came from.
    #[arg(long, value_name = "TRACE", requires = "validate")]
    pub trace: Option<PathBuf>,
    /// --validate: the model name sent in requests.
    #[arg(long, default_value = "default")]
    pub model: String,
    /// --validate: `base` (mean arrivals) or `planned_peak` (p95 arrivals).
    #[arg(long, default_value = "base")]
    pub scenario: String,
    /// --validate: seconds of arrivals.
    #[arg(long, default_value_t = 30.0)]
    pub seconds: f64,
    /// --validate: allowed excess of measured over predicted utilisation.
    #[arg(long, default_value_t = 0.15)]
    pub tolerance: f64,
    /// --validate: synthetic token ids stay below this.
    #[arg(long, default_value_t = 32000)]
    pub vocab_size: usize,
}

/// The workload: from `--workload`, or derived from `--workload-from`'s
/// trace (its TOML printed); and the path to name it by.
fn workload(args: &PlanArgs) -> Result<(Workload, String)> {
    if let Some(t) = &args.workload_from {
        let tpath = t.display().to_string();
        let trace =
            Trace::read(&tpath, None).map_err(|e| anyhow::anyhow!("--workload-from {e}"))?;
        let w = workload_from_trace(&trace);
        let text = format!(
            "# derived by `envelope plan --workload-from {tpath}` from {} requests over {:.1} s\n{}",
            trace.requests.len(),
            trace.span_s(),
            workload_toml(&w)
        );
        if args.json {
            eprint!("{text}");
        } else {
            println!("{text}");
        }
        return Ok((w, tpath));
    }
    let path = args.workload.clone().unwrap_or_default();
    let wpath = path.display().to_string();
    let wtext =
        std::fs::read_to_string(&path).with_context(|| format!("reading --workload {wpath}"))?;
    Ok((Workload::from_toml(&wtext, &wpath)?, wpath))
}

/// The plan, printed; with `--validate`, exit status 1 when the replay
/// found the plan optimistic.
pub fn run(args: &PlanArgs) -> Result<ExitCode> {
    let (workload, wpath) = workload(args)?;
    if !args.tier.is_empty() {
        return tiers::run(args, &workload, &wpath).map(|()| ExitCode::SUCCESS);
    }
    let Some(profile_path) = &args.profile else {
        anyhow::bail!("--profile (or --tier) is required");
    };
    let ppath = profile_path.display().to_string();
    let ptext = std::fs::read_to_string(profile_path)
        .with_context(|| format!("reading --profile {ppath}"))?;
    let profile = Profile::from_json(&ptext, &ppath)?;
    let plan = envelope_profile::plan::plan(&workload, &profile, args.config.as_deref())
        .with_context(|| format!("planning {wpath} on {ppath}"))?;
    if args.validate {
        return validate(args, &workload, &profile, &plan);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", render(&plan, &wpath, &ppath));
    }
    Ok(ExitCode::SUCCESS)
}

fn validate(
    args: &PlanArgs,
    workload: &Workload,
    profile: &Profile,
    plan: &Plan,
) -> Result<ExitCode> {
    let target = args.target.clone().unwrap_or_default();
    if !(args.seconds > 0.0 && args.tolerance >= 0.0) {
        anyhow::bail!("--seconds must be > 0 and --tolerance >= 0");
    }
    let trace = match (&args.trace, &args.workload_from) {
        (Some(t), _) | (None, Some(t)) => Some(
            Trace::read(&t.display().to_string(), None)
                .map_err(|e| anyhow::anyhow!("--trace {e}"))?,
        ),
        (None, None) => None,
    };
    let settings = envelope_harness::replay::ReplaySettings {
        base_url: target.clone(),
        model: args.model.clone(),
        vocab_size: args.vocab_size,
        scenario: args.scenario.clone(),
        seconds: args.seconds,
        tolerance: args.tolerance,
        seed: 1,
    };
    let v =
        envelope_harness::replay::validate(workload, plan, &profile.slo, &settings, trace.as_ref())
            .map_err(|e| anyhow::anyhow!("--validate against {target}: {e}"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", v.table(plan, &target));
    }
    Ok(if v.optimistic {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
