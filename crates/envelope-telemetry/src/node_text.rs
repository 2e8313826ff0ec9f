//! `envelope probe`'s text: the node fingerprint, a live sample and a
//! server's engine state, like a capacity-minded nvidia-smi.

use crate::{EngineState, NodeFingerprint, Sample, Source};

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The node, its live sample and, given a server, that server's engine
/// state (or why it could not be read), a line each.
pub fn node_text(
    node: &NodeFingerprint,
    sample: &Sample,
    server: Option<(&str, &Result<EngineState, String>)>,
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
    if let Some((url, st)) = server {
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
