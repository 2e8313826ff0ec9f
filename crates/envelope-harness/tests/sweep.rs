//! The sweep on dummy weights: a deliberately small KV budget makes the KV
//! cache the binding constraint at the concurrency the block arithmetic
//! predicts; the safe point holds under load; two runs agree.

use envelope_engine::{EngineHandle, EngineSettings, KvBudget, LoadOptions, SchedulerConfig};
use envelope_harness::config::Bucket;
use envelope_harness::config::Prompts;
use envelope_harness::driver::EngineDriver;
use envelope_harness::load::closed_loop;
use envelope_harness::record::Driver;
use envelope_harness::sweep::summarise;
use envelope_harness::{run_sweep, BenchConfig};
use envelope_profile::capacity::{max_sequences_by_tokens, with_headroom};
use envelope_profile::{Constraint, Profile};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn logs() -> PathBuf {
    std::env::temp_dir().join("envelope-sweep-logs")
}

// dummy:tiny in f32: 2 x 2 layers x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token.
// 30 blocks of 16 tokens = 480 tokens; a 16x32 request takes 48 tokens (3 blocks): 10 fit.
// (16x32 rather than 32x16: 32 decode steps keep the workers' requests
// overlapping even when a loaded machine starts a worker late; with 16 a CI
// run once saw 11 fit, every request of the 11th worker finishing in the
// others' gaps.)
const KV_BYTES: usize = 30 * 16 * 512;

/// The two tests load the same two cores; run them one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn config() -> BenchConfig {
    let text = format!(
        r#"
[target]
kind = "engine"
model = "dummy:tiny"
kv_cache_bytes = "{KV_BYTES}"
[matrix]
precisions = ["f32"]
batch_policies = ["continuous", "static"]
buckets = ["16x32"]
concurrency_max = 32
[load]
rounds = 2
# The KV arithmetic is under test, not the machine: a worker stalled by a
# loaded CI machine does not make a probe client-limited.
max_client_gap_ms = 1000
[slo]
itl_p95_ms = 2000
headroom = 0.2
"#
    );
    BenchConfig::parse(&text, Path::new("kv-small.toml")).unwrap()
}

#[test]
fn small_kv_budget_binds_at_the_predicted_concurrency() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = config();
    let out = run_sweep(&cfg, serde_json::json!({}), &logs(), &mut |_| {});
    let p = &out.profile;
    assert_eq!(p.configs.len(), 2);
    for c in &p.configs {
        assert!(c.error.is_none(), "{:?}", c.error);
        assert_eq!(c.memory.kv_capacity_tokens, 480);
        assert_eq!(c.memory.kv_bytes_per_token, 512);
        let b = &c.buckets[0];
        let predicted = max_sequences_by_tokens(480, 16, 32) as u32;
        assert_eq!(predicted, 10);
        assert_eq!(
            b.binding_constraint,
            Constraint::KvCache,
            "{}: {:?}",
            c.name,
            b.probes
                .iter()
                .map(|p| (p.concurrency, p.breaches.clone()))
                .collect::<Vec<_>>()
        );
        let infeasible = b.infeasible_concurrency.unwrap();
        let at_infeasible = b
            .probes
            .iter()
            .find(|p| p.concurrency == infeasible)
            .unwrap();
        assert!(at_infeasible.preemptions.unwrap() > 0);
        // Static batches too: the engine waits for requests sent together
        // (static_batch_wait_ms) before a batch forms, so closed-loop workers
        // stay in phase and every batch holds the whole concurrency.
        assert_eq!(b.feasible_concurrency, predicted, "{}", c.name);
        assert_eq!(infeasible, predicted + 1);
        assert_eq!(b.safe_concurrency, with_headroom(predicted, 0.2));
        assert_eq!(b.safe_concurrency, 8);
    }
    assert!(p.limits.as_ref().unwrap().max_concurrent_seqs >= 8);
    assert_eq!(p.limits.as_ref().unwrap().max_context_tokens, 48);
    assert_eq!(p.limits.as_ref().unwrap().max_kv_tokens_in_flight, 384);
    // Raw data and a profile the governor can read.
    let dir = std::env::temp_dir().join(format!("envelope-sweep-{}", std::process::id()));
    out.write(&dir).unwrap();
    let text = std::fs::read_to_string(dir.join("profile.json")).unwrap();
    Profile::from_json(&text, "profile.json").unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains("| f32-f32-continuous | 16x32 | 10 | 8 | kv_cache |"),
        "{md}"
    );
    assert!(md.contains("max concurrent sequences"));
    assert!(md.contains("![f32-f32-continuous](plots/f32-f32-continuous.svg)"));
    let svg = std::fs::read_to_string(dir.join("plots/f32-f32-static.svg")).unwrap();
    assert!(svg.contains("16x32") && svg.contains("safe"));
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(html.contains("<td>f32-f32-static</td>") && html.ends_with("</html>\n"));
    let probes = std::fs::read_to_string(dir.join("probes.csv")).unwrap();
    assert_eq!(probes.lines().count(), 1 + p.probes_total as usize);
    let telemetry = std::fs::read_to_string(dir.join("telemetry.csv")).unwrap();
    assert!(telemetry.starts_with("probe,t_s,kv_usage,memory_bytes,in_flight"));
    assert!(telemetry.lines().count() > p.probes_total as usize);
    // Every probe has readings, each with a KV figure (the probes are
    // short, so the 100 ms series need not catch the peak: probes.csv has it).
    let probes_with_readings: std::collections::BTreeSet<&str> = telemetry
        .lines()
        .skip(1)
        .inspect(|l| {
            assert!(l
                .split(',')
                .nth(2)
                .is_some_and(|kv| kv.parse::<f64>().is_ok()))
        })
        .filter_map(|l| l.split(',').next())
        .collect();
    assert_eq!(probes_with_readings.len(), p.probes_total as usize);
    let requests = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
    assert!(requests.lines().count() > p.probes_total as usize);
    std::fs::remove_dir_all(&dir).ok();
    // The load shape and the decision rule are stated: bursts by default.
    let load = p.load.as_ref().unwrap();
    assert!(!load.ramp && load.mode == "closed" && load.rounds == 2);
    let rule = p.slo.decision.unwrap();
    assert_eq!((rule.p95.p0, rule.p95.p1), (0.05, 0.10));
    assert!(md.contains("workers started together"), "{md}");
    assert!(md.contains("sequential test at confidence 0.9"), "{md}");

    // Run at the safe concurrency for longer: no preemption, SLOs met.
    let loaded = envelope_engine::load(
        "dummy:tiny",
        &LoadOptions {
            precision: envelope_engine::Precision::F32,
            tokenizer: None,
        },
    )
    .unwrap();
    let e = EngineHandle::spawn(
        loaded,
        &EngineSettings {
            kv_budget: KvBudget::Bytes(KV_BYTES),
            scheduler: SchedulerConfig::default(),
            ..Default::default()
        },
    )
    .unwrap();
    let safe = p.configs[0].buckets[0].safe_concurrency;
    let driver: Arc<dyn Driver> = Arc::new(EngineDriver { engine: e });
    let run = closed_loop(
        &driver,
        &Prompts::Synthetic,
        Bucket::cold(16, 32),
        safe,
        safe * 6,
        77,
        None,
    );
    let s = summarise(&run, safe, &cfg.slo, &cfg.load);
    assert_eq!(s.preemptions, Some(0));
    assert!(s.breaches.is_empty(), "{:?}", s.breaches);
    assert_eq!(s.errors, 0);
}

#[test]
fn a_ramped_sweep_marks_its_warm_up_and_says_so() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let text = r#"
[target]
kind = "engine"
model = "dummy:tiny"
kv_cache_bytes = "4MiB"
[matrix]
precisions = ["f32"]
batch_policies = ["continuous"]
buckets = ["16x32"]
concurrency_max = 4
[load]
rounds = 2
ramp = true
max_client_gap_ms = 1000
[slo]
itl_p95_ms = 2000
"#;
    let cfg = BenchConfig::parse(text, Path::new("ramp.toml")).unwrap();
    let out = run_sweep(&cfg, serde_json::json!({}), &logs(), &mut |_| {});
    let p = &out.profile;
    assert!(p.load.as_ref().unwrap().ramp);
    let probes = &p.configs[0].buckets[0].probes;
    // The first probe (one worker) has no ramp; every probe above it ran
    // the level below's request time as its ramp, and its first requests
    // were warm-up, on top of what the screen needs.
    for s in probes {
        if s.concurrency == 1 {
            assert_eq!(s.warmup_requests, 0);
        } else {
            assert!(s.warmup_requests >= 1, "{s:?}");
            // Two rounds and a round's worth for the warm-up.
            assert!(s.requests >= u64::from(s.concurrency) * 3, "{s:?}");
        }
    }
    assert!(probes.iter().any(|s| s.concurrency > 1));
    let warm = out.requests.iter().filter(|r| r.warmup).count() as u64;
    assert_eq!(warm, probes.iter().map(|s| s.warmup_requests).sum::<u64>());
    let dir = std::env::temp_dir().join(format!("envelope-sweep-ramp-{}", std::process::id()));
    out.write(&dir).unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("workers ramped in"), "{md}");
    let csv = std::fs::read_to_string(dir.join("requests.csv")).unwrap();
    assert!(csv.lines().next().unwrap().contains("warmup"), "{csv}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn two_sweeps_agree_within_one_step() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = config();
    let a = run_sweep(&cfg, serde_json::json!({}), &logs(), &mut |_| {}).profile;
    let b = run_sweep(&cfg, serde_json::json!({}), &logs(), &mut |_| {}).profile;
    for (x, y) in a.configs.iter().zip(&b.configs) {
        let (sx, sy) = (
            x.buckets[0].safe_concurrency as i64,
            y.buckets[0].safe_concurrency as i64,
        );
        assert!((sx - sy).abs() <= 1, "{}: {sx} vs {sy}", x.name);
    }
}

#[test]
fn dataset_prompts_are_tokenized_and_fitted_to_the_bucket() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("envelope-dataset-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("prompts.txt");
    std::fs::write(
        &data,
        "The quick brown fox.\n{\"prompt\": \"Jumps over the lazy dog, twice.\"}\n",
    )
    .unwrap();
    let text = format!(
        r#"
[target]
kind = "engine"
model = "dummy:tiny"
[matrix]
precisions = ["f32"]
batch_policies = ["continuous"]
buckets = ["40x4"]
concurrency_max = 2
[load]
dataset = "{}"
"#,
        data.display()
    );
    let cfg = BenchConfig::parse(&text, Path::new("dataset.toml")).unwrap();
    let out = run_sweep(&cfg, serde_json::json!({}), &logs(), &mut |_| {});
    assert!(out.profile.configs[0].error.is_none());
    // The profile says what ran the engine (the CPU here; on a GPU the
    // kernel source, GEMM path and graphs).
    assert_eq!(out.profile.configs[0].backend.as_deref(), Some("cpu"));
    assert!(!out.requests.is_empty());
    for r in &out.requests {
        assert_eq!((r.input_tokens, r.output_tokens), (40, 4), "{r:?}");
        assert!(r.error.is_empty());
    }
    let bad = text.replace(&data.display().to_string(), "/nonexistent/prompts.txt");
    let e = BenchConfig::parse(&bad, Path::new("dataset.toml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dataset.toml") && e.contains("load.dataset"),
        "{e}"
    );
}

#[test]
fn quality_section_scores_the_selected_precision() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("envelope-quality-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "We hold these truths to be self-evident, that all men are created equal.",
    )
    .unwrap();
    let cfg = |extra: &str| {
        format!(
            r#"
[target]
kind = "engine"
model = "dummy:tiny"
[matrix]
precisions = ["q8_0"]
batch_policies = ["continuous"]
buckets = ["16x4"]
concurrency_max = 2
[quality]
text = "{}"
window_tokens = 32
max_windows = 2
{extra}
"#,
            text.display()
        )
    };
    let c = BenchConfig::parse(&cfg(""), Path::new("q.toml")).unwrap();
    let out = run_sweep(&c, serde_json::json!({}), &logs(), &mut |_| {});
    assert!(out.quality_error.is_none(), "{:?}", out.quality_error);
    let q = out.profile.quality.expect("a quality section");
    assert_eq!(q.precision, "q8_0");
    assert_eq!(q.reference_precision.as_deref(), Some("f32"));
    assert_eq!(q.windows, 2);
    assert!(q.kl_divergence_mean.unwrap() > 0.0, "q8_0 differs from f32");
    assert!(q.perplexity.is_finite() && q.perplexity > 1.0);
    // Errors name the file and the field.
    for (extra, field) in [
        ("reference = \"q3\"", "quality.reference"),
        ("colour = 1", "colour"),
    ] {
        let e = BenchConfig::parse(&cfg(extra), Path::new("q.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("q.toml") && e.contains(field), "{e}");
    }
    let missing = cfg("").replace(&text.display().to_string(), "/nonexistent.txt");
    let e = BenchConfig::parse(&missing, Path::new("q.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("quality.text"), "{e}");
}

/// A warm bucket beside a server with no prefix cache (the embedded
/// engine reports no hits): measured all the same, said to be cold in the
/// profile, the summary and the report, and never made part of the
/// envelope the governor enforces.
#[test]
fn a_warm_bucket_on_a_server_without_a_prefix_cache_is_said_to_be_cold() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let text = r#"
[target]
kind = "engine"
model = "dummy:tiny"
kv_cache_bytes = "4MiB"
[matrix]
precisions = ["f32"]
batch_policies = ["continuous"]
buckets = ["32x8", "32x8@50%"]
concurrency_max = 2
[load]
max_client_gap_ms = 1000
[slo]
itl_p95_ms = 2000
"#;
    let cfg = BenchConfig::parse(text, Path::new("warm.toml")).unwrap();
    let out = run_sweep(&cfg, serde_json::json!({}), &logs(), &mut |_| {});
    let p = &out.profile;
    let buckets = &p.configs[0].buckets;
    assert_eq!(buckets.len(), 2);
    let warm = &buckets[1];
    assert_eq!(warm.label(), "32x8@50%");
    assert!(warm.probes.iter().all(|s| s.requests > 0));
    let prefix = warm.cached_prefix.as_ref().unwrap();
    assert_eq!(prefix.intended_share, 0.5);
    assert_eq!(prefix.observed_hit_rate, None);
    assert!(!prefix.held);
    // The envelope: the cold bucket alone.
    let limits = p.limits.as_ref().unwrap();
    let rows: Vec<String> = limits.buckets.iter().map(|b| b.label()).collect();
    assert_eq!(rows, vec!["32x8"]);
    // Round trip: the profile keeps it, and reads back.
    let back = Profile::from_json(&serde_json::to_string(p).unwrap(), "p.json").unwrap();
    assert_eq!(
        back.configs[0].buckets[1].cached_prefix.as_ref(),
        Some(prefix)
    );
    let dir = std::env::temp_dir().join(format!("envelope-sweep-warm-{}", std::process::id()));
    out.write(&dir).unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("## Warm and cold capacity"), "{md}");
    assert!(
        md.contains("cold: the server reports no prefix-cache hits"),
        "{md}"
    );
    let csv = std::fs::read_to_string(dir.join("probes.csv")).unwrap();
    assert!(csv.contains("32x8@50%"), "{csv}");
    std::fs::remove_dir_all(&dir).ok();
}
