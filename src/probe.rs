//! `envelope probe`: the node fingerprint, a live sample and, given a
//! server, its engine state; like a capacity-minded nvidia-smi.

use crate::cli::ProbeArgs;
use anyhow::Result;
use envelope_telemetry::{
    fetch_engine_state, EngineIdentity, EngineState, ModelIdentity, NodeFingerprint, Nvml, Sample,
    Source,
};
use serde_json::{json, Value};
use std::time::Duration;

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// `http://host:port` or `.../metrics` -> the metrics URL.
pub fn metrics_url(server: &str) -> String {
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

fn text(
    node: &NodeFingerprint,
    sample: &Sample,
    server: &Option<String>,
    state: &Option<std::result::Result<EngineState, String>>,
) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let h = &node.host;
    let _ = match node.source {
        Source::Nvml => writeln!(
            o,
            "node     nvml: driver {}, CUDA {}",
            node.driver_version.as_deref().unwrap_or("?"),
            node.cuda_version.as_deref().unwrap_or("?")
        ),
        Source::Host => writeln!(
            o,
            "node     host fallback ({})",
            node.nvml_unavailable.as_deref().unwrap_or("no NVML")
        ),
    };
    let _ = writeln!(
        o,
        "cpu      {}, {} logical cores, {:.1} GiB RAM ({} {})",
        h.cpu_model.as_deref().unwrap_or("unknown"),
        h.logical_cores,
        gib(h.mem_total_bytes.unwrap_or(0)),
        h.os,
        h.arch
    );
    let hs = &sample.host;
    let _ = writeln!(
        o,
        "memory   available {:.2} GiB of {:.2} GiB; pid {} RSS {:.1} MiB (peak {:.1} MiB)",
        gib(hs.mem_available_bytes.unwrap_or(0)),
        gib(hs.mem_total_bytes.unwrap_or(0)),
        hs.pid,
        hs.process_rss_bytes.unwrap_or(0) as f64 / 1048576.0,
        hs.process_peak_rss_bytes.unwrap_or(0) as f64 / 1048576.0
    );
    for (g, f) in sample.gpus.iter().zip(&node.gpus) {
        let opt = |v: Option<u32>| v.map(|x| x.to_string()).unwrap_or_else(|| "?".into());
        let _ = writeln!(
            o,
            "gpu {}    {} (cc {})  mem {:.1}/{:.1} GiB  util {}%  power {}/{} W  temp {} C  clocks sm {} mem {} MHz  throttle {}",
            g.index,
            g.name.as_deref().unwrap_or("?"),
            f.compute_capability.as_deref().unwrap_or("?"),
            gib(g.memory_used_bytes.unwrap_or(0)),
            gib(g.memory_total_bytes.unwrap_or(0)),
            opt(g.utilization_gpu_pct),
            opt(g.power_draw_mw.map(|p| p / 1000)),
            opt(g.power_limit_mw.map(|p| p / 1000)),
            opt(g.temperature_c),
            opt(g.sm_clock_mhz),
            opt(g.memory_clock_mhz),
            if g.throttle_reasons.is_empty() { "none".to_string() } else { g.throttle_reasons.join(",") }
        );
    }
    if let (Some(url), Some(st)) = (server, state) {
        let f = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_else(|| "-".into());
        let _ = match st {
            Ok(s) => writeln!(
            o,
                "server   {url} ({:?}): running {}  waiting {}  kv {}  preemptions {}  prompt tokens {}  generated {}  (age {} ms){}",
                s.engine,
                f(s.running),
                f(s.waiting),
                s.kv_usage.map(|k| format!("{:.1}%", k * 100.0)).unwrap_or_else(|| "-".into()),
                f(s.preemptions_total),
                f(s.prompt_tokens_total),
                f(s.generation_tokens_total),
                s.age_ms(),
                if s.rejected.is_empty() { String::new() } else { format!("  rejected: {}", s.rejected.join(", ")) }
            ),
            Err(e) => writeln!(
            o,"server   {url}: {e}"),
        };
    }
    o
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
                text(&node, &sample, &args.server, &state).trim_end()
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
