//! `envelope gate`: compare a candidate profile with a baseline under rules;
//! prints the Markdown report, writes gate.json and gate.md with `--out`,
//! and exits 0 (pass), 1 (a rule failed), 2 (unusable input) or 3
//! (inconclusive: per-repeat figures that cannot tell a change from noise).

use anyhow::{Context, Result};
use clap::Args;
use envelope_profile::gate::{gate, markdown, GateReport, GateRules, Verdict};
use envelope_profile::Profile;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct GateArgs {
    /// The baseline profile (e.g. f16).
    #[arg(long, env = "ENVELOPE_GATE_BASELINE")]
    pub baseline: PathBuf,
    /// The candidate profile (e.g. q8_0).
    #[arg(long, env = "ENVELOPE_GATE_CANDIDATE")]
    pub candidate: PathBuf,
    /// Rules (TOML; see bench-configs/gates/README.md). Default: safe
    /// concurrency >= baseline, decode tok/s >= 0.95 x baseline, KL <= 0.02,
    /// top-1 agreement >= 0.97.
    #[arg(long, env = "ENVELOPE_GATE_RULES")]
    pub rules: Option<PathBuf>,
    /// Directory for gate.json and gate.md.
    #[arg(long, env = "ENVELOPE_GATE_OUT")]
    pub out: Option<PathBuf>,
    /// Baseline configuration to compare (default: the rules' or the profile's `selected`).
    #[arg(long)]
    pub baseline_config: Option<String>,
    /// Candidate configuration to compare (default: the rules' or the profile's `selected`).
    #[arg(long)]
    pub candidate_config: Option<String>,
    /// Print the report as JSON instead of Markdown.
    #[arg(long)]
    pub json: bool,
}

fn read_profile(path: &Path, flag: &str) -> Result<Profile> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {flag} {p}"))?;
    Ok(Profile::from_json(&text, &p)?)
}

fn evaluate(args: &GateArgs) -> Result<GateReport> {
    let mut rules = match &args.rules {
        Some(path) => {
            let p = path.display().to_string();
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading --rules {p}"))?;
            GateRules::from_toml(&text, &p)?
        }
        None => GateRules::default_rules(),
    };
    if args.baseline_config.is_some() {
        rules.baseline_config = args.baseline_config.clone();
    }
    if args.candidate_config.is_some() {
        rules.candidate_config = args.candidate_config.clone();
    }
    let a = read_profile(&args.baseline, "--baseline")?;
    let b = read_profile(&args.candidate, "--candidate")?;
    Ok(gate(&a, &b, &rules))
}

/// Runs the gate; its verdict is the exit code, unreadable input exit 2.
pub fn run(args: &GateArgs) -> Result<ExitCode> {
    let code = match evaluate(args) {
        Err(e) => {
            eprintln!("error: {e:#}");
            Verdict::Unusable.exit_code()
        }
        Ok(report) => {
            let md = markdown(&report);
            if let Some(dir) = &args.out {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating --out {}", dir.display()))?;
                std::fs::write(
                    dir.join("gate.json"),
                    serde_json::to_string_pretty(&report)? + "\n",
                )?;
                std::fs::write(dir.join("gate.md"), &md)?;
                eprintln!("wrote {}/gate.json and gate.md", dir.display());
            }
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{md}");
            }
            report.verdict.exit_code()
        }
    };
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}
