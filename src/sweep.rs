//! `envelope sweep`: runs a bench config and writes the profile and raw data.

use crate::cli::SweepArgs;
use anyhow::{Context, Result};
use envelope_harness::config::Target;
use envelope_harness::{BenchConfig, SweepEvent};
use envelope_telemetry::{EngineIdentity, Fingerprint, ModelIdentity, NodeFingerprint};

pub fn run(args: &SweepArgs) -> Result<()> {
    let mut cfg = BenchConfig::load(&args.config)?;
    if let Some(r) = args.repeats {
        cfg.load.repeats = r;
    }
    if let Some(d) = cfg.device.clone() {
        if !matches!(cfg.target, Target::Engine) {
            anyhow::bail!(
                "{}: target.device applies to the engine target only",
                args.config.display()
            );
        }
        let setting: envelope_cuda::DeviceSetting = d
            .parse()
            .map_err(|e| anyhow::anyhow!("{}: target.device: {e}", args.config.display()))?;
        // The harness gets the resolved placement (`auto` decided here).
        let needs: Vec<_> = cfg
            .points
            .iter()
            .filter_map(|p| p.engine.as_ref())
            .map(|e| (e.precision, Some(e.kv_dtype)))
            .collect();
        cfg.device = Some(envelope_engine::device::resolve(setting, &needs)?.to_string());
    }
    // A file or dummy preset is hashed; a name another server serves is kept as its id.
    let model = match &cfg.target {
        Target::Http { .. } => ModelIdentity::Served {
            id: cfg.model.clone(),
        },
        Target::Engine => ModelIdentity::from_spec(&cfg.model)
            .with_context(|| format!("{}: target.model {}", args.config.display(), cfg.model))?,
        Target::Launch { .. } => {
            ModelIdentity::from_spec(&cfg.model).unwrap_or_else(|_| ModelIdentity::Served {
                id: cfg.model.clone(),
            })
        }
    };
    let engine = match &cfg.target {
        Target::Engine => EngineIdentity {
            name: "envelope".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            flags: std::env::args().skip(1).collect(),
        },
        Target::Http { base_url } => EngineIdentity {
            name: "http".into(),
            version: String::new(),
            flags: vec![base_url.clone()],
        },
        Target::Launch { command, .. } => EngineIdentity {
            name: command
                .split_whitespace()
                .next()
                .unwrap_or("launch")
                .rsplit('/')
                .next()
                .unwrap_or("launch")
                .to_string(),
            version: String::new(),
            flags: vec![command.clone()],
        },
    };
    let fp = Fingerprint {
        schema: envelope_telemetry::fingerprint::FINGERPRINT_SCHEMA,
        node: NodeFingerprint::read(),
        engine,
        model,
        precision: cfg
            .points
            .iter()
            .map(|p| p.precision.to_string())
            .collect::<Vec<_>>()
            .join(","),
        kv_dtype: cfg
            .points
            .iter()
            .map(|p| p.kv_dtype.to_string())
            .collect::<Vec<_>>()
            .join(","),
    };
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
    println!(
        "{:<28} {:>9} {:>8} {:>10} {:>14} {:>12} {:>12} {:>11}",
        "config", "bucket", "feasible", "safe", "binding", "out tok/s", "ttft p95 ms", "itl p95 ms"
    );
    for c in &p.configs {
        if let Some(e) = &c.error {
            println!("{:<28} error: {e}", c.name);
            continue;
        }
        for b in &c.buckets {
            let at = b.at_feasible.as_ref();
            println!(
                "{:<28} {:>9} {:>8} {:>10} {:>14} {:>12.1} {:>12.1} {:>11.1}",
                c.name,
                format!("{}x{}", b.input_tokens, b.output_tokens),
                b.feasible_concurrency,
                match b.safe_rate_per_s {
                    Some(r) => format!("{}@{r:.1}/s", b.safe_concurrency),
                    None => b.safe_concurrency.to_string(),
                },
                b.binding_constraint.as_str(),
                at.map_or(0.0, |a| a.output_tok_per_s),
                at.map_or(0.0, |a| a.ttft_ms.p95),
                at.map_or(0.0, |a| a.itl_ms.p95),
            );
        }
    }
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
    let table: Vec<String> = limits
        .buckets
        .iter()
        .map(|b| format!("{} safe at {}", b.label(), b.safe_concurrency))
        .collect();
    println!(
        "envelope per bucket (the governor charges each sequence 1 / its bucket's safe concurrency): {}",
        table.join(", ")
    );
    if let Some(q) = &p.quality {
        println!(
            "quality of {} on {} ({} tokens scored): perplexity {:.3}{}",
            q.precision,
            q.text_set,
            q.tokens_scored,
            q.perplexity,
            match (
                &q.reference_precision,
                q.kl_divergence_mean,
                q.top1_agreement
            ) {
                (Some(r), Some(kl), Some(t1)) =>
                    format!(", against {r}: KL {kl:.5} nats, top-1 agreement {t1:.4}"),
                _ => String::new(),
            }
        );
    }
    println!(
        "wrote {}/profile.json, report.md, report.html, requests.csv, probes.csv",
        args.out.display()
    );
    Ok(())
}
