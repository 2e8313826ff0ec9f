//! The `envelope` command line.

mod cli;
mod cuda_selftest;
mod gate;
mod govern;
mod plan;
mod probe;
mod quality;
mod sweep;

use anyhow::{Context, Result};
use clap::Parser;
use cli::{Cli, Command};
use envelope_engine::{ChatMessage, EngineHandle, GenerateRequest, SamplingParams};
use std::io::Write;
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ENVELOPE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    run(cli.command).unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        ExitCode::FAILURE
    })
}

/// Runs one command: its exit code is 0 unless it states one (`plan
/// --validate`, `gate`); an error is printed and exit 1.
fn run(command: Command) -> Result<ExitCode> {
    let done = |r: Result<()>| r.map(|()| ExitCode::SUCCESS);
    match command {
        Command::Serve(args) => done(serve(args)),
        Command::BenchEngine(args) => {
            let placement = args.engine.placement()?;
            args.engine.apply_threads();
            let plan = envelope_engine::bench::BenchPlan {
                prompt_tokens: args.prompt_tokens,
                decode_tokens: args.decode_tokens,
                concurrency: args.concurrency.clone(),
                decode_prompt_tokens: args.decode_prompt_tokens,
            };
            let machine = envelope_engine::bench::Machine {
                threads: std::env::var("RAYON_NUM_THREADS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(envelope_telemetry::host::logical_cores),
                cpu: envelope_telemetry::host::cpu_model().unwrap_or_else(|| "unknown".into()),
            };
            let cfg = args.engine.engine_settings(placement)?;
            let load = args.engine.load_options();
            let model = &args.engine.model;
            let report = envelope_engine::bench::run(model, &load, placement, cfg, &plan, machine)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.table());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Probe(args) => done(probe::run(&args)),
        Command::Plan(args) => plan::run(&args),
        Command::Gate(args) => gate::run(&args),
        Command::Quality(args) => done(quality::run(&args)),
        Command::Govern(args) => done(govern::run(*args)),
        Command::CudaSelftest(args) => done(cuda_selftest::run(&args)),
        Command::Report(args) => {
            let path = args.profile.display().to_string();
            let text = std::fs::read_to_string(&args.profile)
                .with_context(|| format!("reading {path}"))?;
            let mut profile = envelope_profile::Profile::from_json(&text, &path)?;
            let dir = args.out.clone().unwrap_or_else(|| {
                args.profile
                    .parent()
                    .map(|p| p.to_path_buf())
                    .unwrap_or_default()
            });
            if args.upgrade {
                profile.schema = envelope_profile::PROFILE_SCHEMA.into();
                let to = dir.join("profile.json");
                std::fs::create_dir_all(&dir)?;
                std::fs::write(&to, serde_json::to_string_pretty(&profile)? + "\n")
                    .with_context(|| format!("writing {}", to.display()))?;
                println!("wrote {} ({})", to.display(), profile.schema);
            }
            envelope_harness::report::write_all(&profile, &dir)
                .with_context(|| format!("writing reports into {}", dir.display()))?;
            println!("wrote {}/report.md, report.html and plots/", dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Sweep(args) => {
            if let Some(n) = args.threads {
                std::env::set_var("RAYON_NUM_THREADS", n.to_string());
            }
            done(sweep::run(&args))
        }
        Command::Generate(args) => {
            let placement = args.engine.placement()?;
            args.engine.apply_threads();
            let handle = EngineHandle::load_and_spawn(
                &args.engine.model,
                &args.engine.load_options(),
                placement,
                &args.engine.engine_settings(placement)?,
            )
            .with_context(|| format!("loading --model {}", args.engine.model))?;
            let text = if args.chat {
                handle.chat_template.render(
                    &[ChatMessage {
                        role: "user".into(),
                        content: args.prompt.clone(),
                    }],
                    true,
                )?
            } else {
                args.prompt.clone()
            };
            let prompt_tokens = handle.tokenizer.encode(&text)?;
            let params = SamplingParams {
                temperature: args.temperature,
                seed: args.seed,
                ..SamplingParams::greedy(args.max_tokens)
            };
            let out = handle.generate_blocking(GenerateRequest {
                prompt_tokens,
                params,
            })?;
            println!("{}", out.text);
            std::io::stdout().flush()?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn serve(args: cli::ServeArgs) -> Result<()> {
    let placement = args.engine.placement()?;
    args.engine.apply_threads();
    let cfg = args.engine.engine_settings(placement)?;
    let handle = EngineHandle::load_and_spawn(
        &args.engine.model,
        &args.engine.load_options(),
        placement,
        &cfg,
    )
    .with_context(|| format!("loading --model {}", args.engine.model))?;
    let addr = format!("{}:{}", args.host, args.port);
    envelope_server::serve_blocking(handle, args.served_model_name.clone(), &addr)
        .with_context(|| format!("serving on --host/--port {addr}"))
}
