//! The table of docs/measurements/2026-12-07-agents-warm-cold-vllm.md,
//! run by hand (it takes about 30 minutes):
//!
//! ```sh
//! eval "$(scripts/foreign-servers.sh)"; export ENVELOPE_VLLM_PYTHON ENVELOPE_VLLM_MODEL
//! cargo test --profile ci --test it -- --ignored foreign_servers::vllm::agents_page --nocapture
//! ```
//!
//! Issue #62's workload beside vLLM's CPU build at its defaults (1 GiB of
//! KV, prefix caching on): closed-loop agents, each session a ~600-word
//! system prompt shared by every session, then 5 calls each adding a
//! ~60-word tool result and the previous answer, 32 tokens out. The sweep
//! at defaults with the issue's buckets and one warm bucket; `envelope
//! govern` with no flag but profile, upstream and listen. One run a side
//! (`ENVELOPE_PAGE_SECONDS`, default 60 s): 8 agents, 16 agents, 8 agents
//! with the system prompt's version changed for new sessions halfway, and
//! 8 agents beside a second vLLM with prefix caching off.

use super::super::agents::{agents_shaped, Shape};
use super::*;
use std::sync::atomic::AtomicU64;

const PAGE: Shape = Shape {
    system_sentences: 46,
    calls: 5,
    tool_sentences: 5,
    output: 32,
};

/// vLLM's prefix-cache counters now: (queries, hits), in prompt tokens.
fn counters(base: &str) -> (f64, f64) {
    let page = reqwest::blocking::get(format!("{base}/metrics"))
        .and_then(|r| r.text())
        .unwrap_or_default();
    let sum = |name: &str| -> f64 {
        page.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (
        sum("vllm:prefix_cache_queries_total"),
        sum("vllm:prefix_cache_hits_total"),
    )
}

/// The TTFT p95 of the answers that ended after `from_s`.
fn ttft_p95_after(outcomes: &[Outcome], from_s: f64) -> f64 {
    let mut ttft: Vec<f64> = outcomes
        .iter()
        .filter(|o| o.end_s >= from_s)
        .filter_map(|o| o.ttft_s)
        .collect();
    ttft.sort_by(f64::total_cmp);
    ttft.get(((ttft.len() as f64 * 0.95).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(f64::INFINITY)
}

/// One side of a case: goodput, TTFT p95 (and after `change_s`), 429s,
/// answers, and vLLM's hit rate over the run.
fn run_side(
    server: &Foreign,
    base: &str,
    clients: usize,
    secs: u64,
    change_s: Option<u64>,
) -> String {
    let version = Arc::new(AtomicU64::new(0));
    let changer = change_s.map(|at| {
        let v = version.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(at));
            v.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        })
    });
    let before = counters(&server.base);
    let out = agents_shaped(
        base,
        clients,
        10_000,
        Duration::from_secs(secs),
        version,
        PAGE,
    );
    let after = counters(&server.base);
    if let Some(c) = changer {
        let _ = c.join();
    }
    let (good, p95) = goodput(&out);
    let refused = out.iter().filter(|o| o.status == 429).count();
    let answered = out.iter().filter(|o| o.whole).count();
    let hits = (after.1 - before.1) / (after.0 - before.0).max(1.0);
    let after_change = change_s.map_or(String::new(), |at| {
        format!(
            ", after the change {:.2} s",
            ttft_p95_after(&out, at as f64)
        )
    });
    format!("{good:.2}/s (TTFT p95 {p95:.2} s{after_change}; {answered} answers, {refused} 429s; vLLM hit rate {hits:.2})")
}

#[test]
#[ignore = "the dated page's measurement: about 30 minutes, run by hand"]
fn agents_page() {
    let _serial = one_at_a_time();
    let secs: u64 = std::env::var("ENVELOPE_PAGE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let dir = temp_dir("envelope-foreign", "vllm-agents-page");
    let buckets = r#"["256x32", "1024x32", "1536x32", "1024x32@85%"]"#;
    let flags = ["--max-model-len", "2048"];
    let (server, profile, _, g) = swept_and_governed_with(&dir, None, &flags, buckets);
    let mut table = String::from("| case | direct | governed |\n|---|---|---|\n");
    for (case, clients, change) in [
        ("8 agents, shared system prompt, cache on", 8, None),
        ("16 agents, shared system prompt, cache on", 16, None),
        (
            "8 agents, the system prompt's version changes for new sessions at half time",
            8,
            Some(secs / 2),
        ),
    ] {
        let direct = run_side(&server, &server.base, clients, secs, change);
        let governed = run_side(&server, &g.base, clients, secs, change);
        let row = format!("| {case} | {direct} | {governed} |\n");
        eprint!("{row}");
        table += &row;
    }
    let state = reqwest::blocking::get(g.url("/admin/state"))
        .and_then(|r| r.json::<Value>())
        .map(|s| s["prefix_cache"].to_string())
        .unwrap_or_default();
    eprintln!("governor's prefix view: {state}");
    drop((g, server));
    let off = ["--max-model-len", "2048", "--no-enable-prefix-caching"];
    let server = vllm_with(&dir, None, &off);
    let gdir = dir.join("govern-cache-off");
    std::fs::create_dir_all(&gdir).unwrap();
    let g = Governor::start_with_defaults(&gdir, &dir.join("out/profile.json"), &server.base);
    let direct = run_side(&server, &server.base, 8, secs, None);
    let governed = run_side(&server, &g.base, 8, secs, None);
    table +=
        &format!("| 8 agents, the same server with prefix caching off | {direct} | {governed} |\n");
    eprintln!("\n{}\n{table}", probes_of(&profile));
    let report = std::fs::read_to_string(dir.join("out/report.md")).unwrap_or_default();
    if let Some(i) = report.find("## Warm and cold capacity") {
        eprintln!(
            "{}",
            &report[i..report[i..]
                .find("\n## Memory")
                .map_or(report.len(), |j| i + j)]
        );
    }
}
