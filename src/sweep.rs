//! `envelope sweep`: runs a bench config and writes the profile and raw data.

use crate::cli::SweepArgs;
use anyhow::{Context, Result};
use envelope_harness::{BenchConfig, SweepEvent};

pub fn run(args: &SweepArgs) -> Result<()> {
    let mut cfg = BenchConfig::load(&args.config)?;
    if let Some(r) = args.repeats {
        cfg.load.repeats = r;
    }
    let file = args.config.display().to_string();
    envelope_harness::identity::resolve_device(&mut cfg, &file)?;
    let flags = std::env::args().skip(1).collect();
    let fp = envelope_harness::identity::fingerprint(&cfg, &file, flags)?;
    let start = std::time::Instant::now();
    let bar = indicatif::ProgressBar::new(envelope_harness::expected_probes(&cfg));
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/~{len} probes, ETA {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let log_dir = args.out.join("logs");
    let out =
        envelope_harness::run_sweep(&cfg, serde_json::to_value(&fp)?, &log_dir, &mut |event| {
            match event {
                SweepEvent::Probing(line) => {
                    if bar.is_hidden() && !args.json {
                        eprintln!("[{:>6.1}s] {line}", start.elapsed().as_secs_f64());
                    }
                    bar.set_message(line.to_string());
                }
                SweepEvent::Note(line) => {
                    // What the harness found out about a server: always said.
                    bar.suspend(|| {
                        eprintln!("[{:>6.1}s] note: {line}", start.elapsed().as_secs_f64())
                    });
                }
                SweepEvent::Probed(row) => {
                    if args.json {
                        // One JSON line per probe, as it ends.
                        if let Ok(v) = serde_json::to_value(row) {
                            println!("{}", serde_json::json!({"event": "probe", "probe": v}));
                        }
                    }
                    if bar.position() >= bar.length().unwrap_or(0) {
                        bar.inc_length(1);
                    }
                    bar.inc(1);
                }
            }
        });
    bar.finish_and_clear();
    out.write(&args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    if let Some(e) = &out.quality_error {
        eprintln!("warning: {e} (the profile has no quality section)");
    }
    let p = &out.profile;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"event": "profile", "profile": serde_json::to_value(p)?})
        );
        if let Some(why) = &p.no_safe_point {
            anyhow::bail!("no configuration had a safe operating point: {why}");
        }
        return Ok(());
    }
    print!("{}", envelope_harness::report::summary::configs_table(p));
    let Some(limits) = &p.limits else {
        println!(
            "{} probes in {:.0} s; NO SAFE OPERATING POINT: {}",
            p.probes_total,
            start.elapsed().as_secs_f64(),
            p.no_safe_point.as_deref().unwrap_or_default()
        );
        println!(
            "wrote {}/profile.json (limits: null), report.md, report.html, requests.csv, probes.csv",
            args.out.display()
        );
        anyhow::bail!(
            "no configuration had a safe operating point; see {}/report.md",
            args.out.display()
        );
    };
    println!(
        "{} probes in {:.0} s; selected {}; limits: context {} tokens, output {} tokens, {} sequences, {} KV tokens in flight",
        p.probes_total,
        start.elapsed().as_secs_f64(),
        p.selected,
        limits.max_context_tokens,
        limits.max_output_tokens,
        limits.max_concurrent_seqs,
        limits.max_kv_tokens_in_flight
    );
    print!(
        "{}",
        envelope_harness::report::summary::envelope_lines(p, limits)
    );
    println!(
        "wrote {}/profile.json, report.md, report.html, requests.csv, probes.csv",
        args.out.display()
    );
    Ok(())
}
