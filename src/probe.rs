//! `envelope probe`: the node fingerprint, a live sample and, given a
//! server, its engine state; like a capacity-minded nvidia-smi.

use crate::cli::ProbeArgs;
use anyhow::Result;
use envelope_telemetry::node_text::node_text;
use envelope_telemetry::{
    fetch_engine_state, EngineIdentity, EngineState, ModelIdentity, NodeFingerprint, Nvml, Sample,
};
use serde_json::{json, Value};
use std::time::Duration;

/// `http://host:port` or `.../metrics` -> the metrics URL.
fn metrics_url(server: &str) -> String {
    let s = server.trim_end_matches('/');
    if s.ends_with("/metrics") {
        s.to_string()
    } else {
        format!("{s}/metrics")
    }
}

async fn server_state(server: &Option<String>) -> Option<std::result::Result<EngineState, String>> {
    let s = server.as_ref()?;
    Some(
        fetch_engine_state(&metrics_url(s), Duration::from_secs(5))
            .await
            .map_err(|e| e.to_string()),
    )
}

/// Writes a line to stdout; `false` when the reader has gone (a closed pipe ends the probe quietly).
fn emit(line: &str) -> Result<bool> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|_| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

pub fn run(args: &ProbeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let node = NodeFingerprint::read();
    let nvml = Nvml::init().ok();
    let model = match &args.model {
        Some(m) => {
            Some(ModelIdentity::from_spec(m).map_err(|e| anyhow::anyhow!("--model {m}: {e}"))?)
        }
        None => None,
    };
    let engine = EngineIdentity {
        name: "envelope".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        flags: std::env::args().skip(1).collect(),
    };
    let mut n = 0u64;
    loop {
        let sample = Sample::take(nvml.as_ref(), args.pid);
        let state = rt.block_on(server_state(&args.server));
        if args.json {
            let server: Value = match &state {
                None => Value::Null,
                Some(Ok(s)) => serde_json::to_value(s)?,
                Some(Err(e)) => json!({"error": e}),
            };
            let out = json!({"node": node, "engine": engine, "model": model, "sample": sample, "server": server});
            let line = if args.watch {
                out.to_string()
            } else {
                serde_json::to_string_pretty(&out)?
            };
            if !emit(&line)? {
                return Ok(());
            }
        } else {
            let head = if n == 0 || !args.watch {
                "envelope probe\n"
            } else {
                ""
            };
            if !emit(&format!(
                "{head}{}",
                node_text(&node, &sample, args.server.as_deref().zip(state.as_ref())).trim_end()
            ))? {
                return Ok(());
            }
        }
        n += 1;
        if !args.watch || args.count.is_some_and(|c| n >= c) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(args.interval_ms));
    }
}
