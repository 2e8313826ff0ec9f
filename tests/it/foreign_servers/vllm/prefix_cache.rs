//! Agents beside vLLM's prefix cache (seed 000, section 7): sessions that
//! share a system prompt, direct and governed in alternating blocks,
//! with the cache on (vLLM's default) and off (the cache failure). The
//! governor must charge what a call costs vLLM (its uncached tokens) when
//! vLLM reports the hits, and the cold envelope when it does not.

use super::super::agents::{agents, longest_prompt, OUTPUT as AGENT_OUTPUT};
use super::*;
use std::sync::atomic::AtomicU64;

/// A warm call's uncached prompt and output at most, in tokens: a
/// session's calls send 347, 403 and 460 prompt tokens, of which vLLM
/// finds 256, 256 and 384 in its blocks of 128 (the system prompt, then
/// the session so far), so 107, 163 and 92 with the output. Cold, the
/// same calls are 363 to 476 tokens.
const WARM_CALL_TOKENS: u64 = 170;
/// Agents at once: as many as the profile admits of the costliest warm
/// call (6 on a 2-core AMD EPYC here, where the cold envelope admits 2
/// or 3 of their calls).
fn agents_for(profile: &Value) -> usize {
    shape_concurrency(profile, WARM_CALL_TOKENS).min(16)
}
/// Pairs of blocks a side, each block one session of every agent.
const PAIRS_WARM: usize = 3;
const PAIRS_COLD: usize = 2;

/// A number the governor's `/metrics` gives, summed over its labels; a
/// series that is not on the page fails (a renamed one must not read 0).
fn present_metric(g: &Governor, name: &str) -> f64 {
    let page = reqwest::blocking::get(g.url("/metrics"))
        .unwrap()
        .text()
        .unwrap();
    assert!(
        page.lines().any(|l| l.starts_with(name)),
        "{name} is not on the governor's /metrics"
    );
    governor_metric(g, name)
}

/// What the governor says of vLLM's prefix cache.
fn prefix_line(g: &Governor) -> (String, f64, f64) {
    let trust = present_metric(g, "envelope_governor_prefix_cache_trust");
    let credited = present_metric(g, "envelope_governor_prefix_cache_credited_tokens_total");
    let estimated = present_metric(g, "envelope_governor_prefix_cache_estimated_tokens_total");
    let est_rate = present_metric(g, "envelope_governor_prefix_cache_estimated_hit_rate");
    let obs_rate = present_metric(g, "envelope_governor_prefix_cache_observed_hit_rate");
    let line = format!(
        "governor: trust {trust:.2}, hit rate estimated {est_rate:.2} observed {obs_rate:.2} (last reading), prompt tokens estimated cached {estimated}, credited {credited}"
    );
    eprintln!("{line}");
    (line, trust, credited)
}

/// The agents' longest prompt fits the profile's largest bucket whole
/// (past it the governor refuses them, cache or not).
fn assert_agents_fit(server: &Foreign, profile: &Value) {
    let count = |messages: &Value| {
        server_count(
            &server.base,
            "/tokenize",
            json!({"model": "smollm2", "messages": messages}),
        )
    };
    let longest = longest_prompt(&count, &"word ".repeat(AGENT_OUTPUT as usize));
    let largest = profile["limits"]["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["input_tokens"].as_u64().unwrap() + b["output_tokens"].as_u64().unwrap())
        .max()
        .unwrap();
    eprintln!(
        "agents' longest prompt: {longest} tokens + {AGENT_OUTPUT} out, largest bucket {largest}"
    );
    assert!(
        longest + AGENT_OUTPUT <= largest,
        "{longest} + {AGENT_OUTPUT} > {largest}"
    );
}

fn agent_blocks(server: &Foreign, g: &Governor, clients: usize, pairs: usize) -> Blocks {
    let version = Arc::new(AtomicU64::new(0));
    let cap = Duration::from_secs(180);
    in_blocks(server, g, pairs, |base| {
        agents(base, clients, 1, cap, version.clone())
    })
}

/// With vLLM's prefix cache on (its default): governed goodput at least
/// 0.9 of direct while direct meets the SLO, and the governor credited
/// cached tokens. A governor that charges every prompt token as new
/// admits about half of the agents and fails the line.
pub(super) fn agents_with_the_cache(
    server: &Foreign,
    profile: &Value,
    g: &Governor,
) -> (String, Vec<String>) {
    assert_agents_fit(server, profile);
    let clients = agents_for(profile);
    let blocks = agent_blocks(server, g, clients, PAIRS_WARM);
    let (line, decision, (lo, hi)) = blocks_line(
        "agents sharing a system prompt, prefix cache on",
        clients,
        &blocks,
        g,
        |d, gv| decided(d, gv, 0.9),
    );
    let (prefix, _, credited) = prefix_line(g);
    let mut failed = vec![];
    match meets_the_slo(&blocks.answers[0]) {
        Decision::Breached => failed.extend(breaks_the_slo(&blocks, "cache on")),
        _ if decision == Decision::Breached => failed.push(format!(
            "cache on: governed >= 0.9 x direct (interval of the ratio {lo:.2}..{hi:.2})"
        )),
        _ => {}
    }
    if credited <= 0.0 {
        failed.push("cache on: the governor credited no cached token".into());
    }
    (format!("{line}{prefix}\n"), failed)
}

/// Where direct breaks the SLO: governed TTFT p95 not shown over it, and
/// goodput at least direct's.
fn breaks_the_slo(blocks: &Blocks, case: &str) -> Vec<String> {
    let mut failed = vec![];
    if meets_the_slo(&blocks.answers[1]) == Decision::Breached {
        failed.push(format!(
            "{case}: direct breaks the SLO: governed TTFT p95 not shown over it"
        ));
    }
    let (decision, (lo, hi)) = decided(&blocks.goodputs[0], &blocks.goodputs[1], 1.0);
    if decision == Decision::Breached {
        failed.push(format!(
            "{case}: direct breaks the SLO: governed >= direct (interval of the ratio {lo:.2}..{hi:.2})"
        ));
    }
    failed
}

/// The same profile beside a vLLM with prefix caching off (the cache
/// failure): the governor credits nothing (vLLM says it keeps no prefix),
/// so its TTFT p95 is not shown over the SLO and its goodput is at least
/// direct's. A governor that trusts its own record of what it sent over
/// what vLLM reports admits them all and breaks the SLO as direct does.
pub(super) fn agents_without_the_cache(dir: &Path, profile: &Value) -> (String, Vec<String>) {
    let t0 = Instant::now();
    let server = vllm_with(dir, None, &["--no-enable-prefix-caching"]);
    eprintln!(
        "vLLM (prefix caching off) ready in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    let gdir = dir.join("govern-cache-off");
    std::fs::create_dir_all(&gdir).unwrap();
    let g = Governor::start_with_defaults(&gdir, &dir.join("out/profile.json"), &server.base);
    let clients = agents_for(profile);
    let blocks = agent_blocks(&server, &g, clients, PAIRS_COLD);
    let (line, _, _) = blocks_line(
        "agents sharing a system prompt, prefix cache off",
        clients,
        &blocks,
        &g,
        |d, gv| decided(d, gv, 1.0),
    );
    let (prefix, trust, credited) = prefix_line(&g);
    let mut failed = match meets_the_slo(&blocks.answers[0]) {
        Decision::Breached => breaks_the_slo(&blocks, "cache off"),
        _ => {
            let headroom = profile["slo"]["headroom"].as_f64().unwrap();
            let (decision, (lo, hi)) = decided(
                &blocks.goodputs[0],
                &blocks.goodputs[1],
                1.0 - headroom - 0.05,
            );
            (decision == Decision::Breached)
                .then(|| format!("cache off: direct meets the SLO: governed >= (1 - headroom - 0.05) x direct (interval {lo:.2}..{hi:.2})"))
                .into_iter()
                .collect()
        }
    };
    if credited > 0.0 || trust > 0.0 {
        failed.push(format!(
            "cache off: the governor credited {credited} tokens (trust {trust}) that vLLM did not find"
        ));
    }
    (format!("{line}{prefix}\n"), failed)
}

/// The sweep's warm bucket (`512x32@75%`) beside vLLM's prefix cache at
/// its defaults: the server found the shared prefix (its hit rate at least
/// half the intended 75%: whole 128-token blocks), so the bucket is
/// measured warm; it holds more sequences than the cold 512x32, and the
/// envelope the governor enforces is the cold buckets' alone.
pub(super) fn warm_bucket_held(profile: &Value) -> Vec<String> {
    let mut failed = vec![];
    let buckets = profile["configs"][0]["buckets"].as_array().unwrap();
    let shape = |warm: bool| {
        buckets
            .iter()
            .find(|b| b["input_tokens"] == 512 && b["cached_prefix"].is_object() == warm)
    };
    let (Some(cold), Some(warm)) = (shape(false), shape(true)) else {
        return vec![format!("no cold and warm 512x32 buckets: {buckets:?}")];
    };
    let prefix = &warm["cached_prefix"];
    let hits = prefix["observed_hit_rate"].as_f64().unwrap_or(-1.0);
    eprintln!(
        "warm 512x32@75%: safe {} (cold {}), server's hit rate {hits:.2}, held {}",
        warm["safe_concurrency"], cold["safe_concurrency"], prefix["held"]
    );
    if prefix["held"] != true || hits < 0.5 {
        failed.push(format!("the warm bucket was not measured warm: {prefix}"));
    }
    let feasible = |b: &Value| b["feasible_concurrency"].as_u64().unwrap_or(0);
    if feasible(warm) <= feasible(cold) {
        failed.push(format!(
            "warm 512x32 feasible at {} is not above cold's {}",
            feasible(warm),
            feasible(cold)
        ));
    }
    let rows = profile["limits"]["buckets"].as_array().unwrap();
    if rows.len() != 3
        || rows
            .iter()
            .any(|r| r["input_tokens"] == 512 && r["safe_concurrency"] != cold["safe_concurrency"])
    {
        failed.push(format!("the envelope is not the cold buckets': {rows:?}"));
    }
    failed
}
