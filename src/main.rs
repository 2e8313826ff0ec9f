//! The `envelope` command line.

mod bench;
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

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ENVELOPE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::BenchEngine(args) => {
            let placement = args.engine.placement()?;
            args.engine.apply_threads();
            let report = bench::run(&args, placement)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                bench::print_table(&report);
            }
            Ok(())
        }
        Command::Probe(args) => probe::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Gate(args) => gate::run(&args),
        Command::Quality(args) => quality::run(&args),
        Command::Govern(args) => govern::run(*args),
        Command::CudaSelftest(args) => cuda_selftest::run(&args),
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
            Ok(())
        }
        Command::Sweep(args) => {
            if let Some(n) = args.threads {
                std::env::set_var("RAYON_NUM_THREADS", n.to_string());
            }
            sweep::run(&args)
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
            Ok(())
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
    let info = handle.info.model.clone();
    tracing::info!(
        "loaded {} on {placement} in {:.1}s: {} parameters, weights {:.1} MiB ({})",
        info.source,
        info.load_seconds,
        info.weights.num_parameters,
        info.weights.total_bytes as f64 / 1048576.0,
        info.weights.formats.join("+")
    );
    let name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| info.name.clone());
    let ei = &handle.info;
    tracing::info!("backend: {}", ei.backend);
    tracing::info!(
        "KV cache: {} blocks x {} tokens = {} tokens, {:.1} MiB ({} bytes/token, {}); max model len {}",
        ei.kv_blocks_total,
        ei.block_size,
        ei.kv_capacity_tokens,
        ei.kv_pool_bytes as f64 / 1048576.0,
        ei.kv_bytes_per_token,
        ei.kv_dtype,
        ei.max_model_len
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding --host/--port {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!("serving {name} on http://{local}");
        // A line on stdout that scripts and tests wait for.
        println!("envelope serve listening on http://{local}");
        std::io::stdout().flush()?;
        let state = envelope_server::AppState::new(handle.clone(), name);
        envelope_server::serve(state, listener).await?;
        handle.shutdown();
        Ok(())
    })
}
