//! `envelope sweep` through its three targets, on dummy weights with a
//! deliberately small KV pool (so the KV cache binds at a concurrency the
//! block arithmetic predicts, whatever the machine's speed):
//! - the embedded engine and `launch` (envelope serve started by the harness)
//!   agree within one ladder step;
//! - `http` with open-loop Poisson arrivals finds a feasible rate;
//! - a launched server that dies is a data point, not the end of the sweep.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

// dummy:tiny in f32: 512 bytes of KV per token; 60 blocks of 16 tokens = 960
// tokens; a 32x48 request takes 5 blocks, so 12 fit. Its 32-token prompt fills
// two blocks, so every decode step past the 32nd needs all five: requests in
// flight together preempt past 12 even when HTTP staggers their starts by a
// few steps (with short outputs, a tiny model finishes a request in about the
// time an HTTP round trip takes, and the server never sees them all at once).
const KV_BYTES: usize = 60 * 16 * 512;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_envelope")
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("envelope-sweep-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const MATRIX: &str = r#"
[matrix]
precisions = ["f32"]
batch_policies = ["continuous"]
max_num_seqs = 32
buckets = ["32x48"]
concurrency_max = 32
"#;

const SLO: &str = r#"
[slo]
itl_p95_ms = 5000
headroom = 0.2
"#;

// The KV arithmetic is under test, not the machine: a worker stalled by a
// loaded CI machine does not make a probe client-limited.
const LOAD: &str = r#"
[load]
max_client_gap_ms = 1000
"#;

/// Runs `envelope sweep --json`; returns the per-probe lines and the profile.
fn sweep(dir: &Path, config: &str) -> (Vec<Value>, Value) {
    let cfg = dir.join("bench.toml");
    std::fs::write(&cfg, config).unwrap();
    let out = Command::new(bin())
        .args(["sweep", "--json", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(dir.join("out"))
        .env("ENVELOPE_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "sweep failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let (profile, probes): (Vec<_>, Vec<_>) =
        lines.into_iter().partition(|v| v["event"] == "profile");
    assert_eq!(profile.len(), 1, "one profile line at the end");
    assert!(probes.iter().all(|p| p["event"] == "probe"));
    for f in [
        "profile.json",
        "report.md",
        "report.html",
        "probes.csv",
        "requests.csv",
    ] {
        assert!(dir.join("out").join(f).exists(), "{f} written");
    }
    (probes, profile[0]["profile"].clone())
}

fn bucket(profile: &Value) -> &Value {
    let c = &profile["configs"][0];
    assert!(c["error"].is_null(), "{}", c["error"]);
    &c["buckets"][0]
}

#[test]
fn engine_and_launch_targets_agree_within_one_ladder_step() {
    let d = out_dir("engine");
    let engine_cfg = format!(
        "[target]\nkind = \"engine\"\nmodel = \"dummy:tiny\"\nkv_cache_bytes = \"{KV_BYTES}\"\n{MATRIX}{LOAD}{SLO}"
    );
    let (probes, engine) = sweep(&d, &engine_cfg);
    assert_eq!(
        probes.len() as u64,
        engine["probes_total"].as_u64().unwrap()
    );
    let eb = bucket(&engine);
    assert_eq!(eb["binding_constraint"], "kv_cache");
    assert_eq!(eb["feasible_concurrency"], 12, "{eb}");
    let plot = d.join("out/plots/f32-f32-continuous.svg");
    assert!(std::fs::read_to_string(plot).unwrap().contains("32x48"));

    let d = out_dir("launch");
    let launch_cfg = format!(
        r#"[target]
kind = "launch"
model = "tiny"
kv_cache_bytes = "{KV_BYTES}"
vocab_size = 256
command = "{} serve --model dummy:tiny --served-model-name {{model}} --precision {{precision}} --kv-dtype {{kv_dtype}} --batch-policy {{batch_policy}} --max-num-seqs {{max_num_seqs}} --max-num-batched-tokens {{max_num_batched_tokens}} --kv-cache-bytes {{kv_cache_bytes}} --block-size {{block_size}} --host 127.0.0.1 --port {{port}}"
ready_timeout_s = 120
{MATRIX}{LOAD}{SLO}"#,
        bin()
    );
    let (_, launch) = sweep(&d, &launch_cfg);
    let lb = bucket(&launch);
    assert_eq!(lb["binding_constraint"], "kv_cache", "{lb}");
    let (e, l) = (
        eb["safe_concurrency"].as_i64().unwrap(),
        lb["safe_concurrency"].as_i64().unwrap(),
    );
    // The bisection ends on adjacent values: one step is 1.
    assert!((e - l).abs() <= 1, "engine safe {e}, launch safe {l}");
    eprintln!("safe concurrency: engine {e}, launch {l}");
    // KV use and preemptions came from the launched server's /metrics.
    let probes = lb["probes"].as_array().unwrap();
    assert!(probes.iter().any(|p| p["preemptions"].as_u64() > Some(0)));
    assert!(probes.iter().all(|p| p["kv_usage_max"].as_f64().is_some()));
    let log = std::fs::read_dir(d.join("out/logs")).unwrap().count();
    assert!(log >= 1, "the server's log is kept");
    assert_eq!(launch["fingerprint"]["model"]["kind"], "served");
    assert_eq!(launch["fingerprint"]["engine"]["name"], "envelope");
    assert_eq!(launch["configs"][0]["memory"]["source"], "process_rss");
    // The KV capacity came from envelope serve's /metrics, so the limit matches the engine's.
    assert_eq!(launch["configs"][0]["memory"]["kv_capacity_tokens"], 960);
    assert_eq!(
        launch["limits"]["max_kv_tokens_in_flight"],
        engine["limits"]["max_kv_tokens_in_flight"]
    );
}

#[test]
fn http_target_with_poisson_arrivals_finds_a_feasible_rate() {
    let server = common::Server::start(&[
        "--model",
        "dummy:tiny",
        "--served-model-name",
        "tiny",
        "--kv-cache-bytes",
        "4MiB",
    ]);
    let d = out_dir("poisson");
    let cfg = format!(
        r#"[target]
kind = "http"
model = "tiny"
base_url = "{}"
vocab_size = 256
[matrix]
buckets = ["16x8"]
[load]
mode = "poisson"
rate_min_per_s = 4
rate_step_per_s = 4
rate_max_per_s = 16
duration_s = 1.5
min_requests = 4
# The search is under test, not the machine: arrivals a loaded CI machine
# sends late do not make a probe client-limited.
late_after_ms = 500
max_late_fraction = 0.5
[slo]
e2e_p99_ms = 10000
headroom = 0.25
"#,
        server.base
    );
    let (probes, profile) = sweep(&d, &cfg);
    let b = bucket(&profile);
    // Over loopback a tiny model keeps up with 16 req/s: the search ends at its cap.
    assert_eq!(b["binding_constraint"], "search_cap", "{b}");
    assert_eq!(b["feasible_rate_per_s"], 16.0);
    assert_eq!(b["safe_rate_per_s"], 12.0);
    for p in &probes {
        let rate = p["probe"]["offered_rate_per_s"].as_f64().unwrap();
        let n = p["probe"]["requests"].as_u64().unwrap();
        assert_eq!(n, ((rate * 1.5).round() as u64).max(4));
        assert_eq!(p["probe"]["errors"], 0);
        assert!(p["probe"]["valid"].as_bool().unwrap());
    }
    assert_eq!(profile["configs"][0]["name"], "as-served-f32-as-served");
    assert_eq!(profile["fingerprint"]["model"]["kind"], "served");
    assert!(b["feasible_concurrency"].as_u64().unwrap() >= 1);
    // 4 MiB of f32 KV at 512 bytes per token, read from the server's /metrics.
    assert_eq!(profile["configs"][0]["memory"]["kv_capacity_tokens"], 8192);

    // A model name the server does not serve: the configuration fails with
    // the server's answer instead of being searched.
    let d = out_dir("wrong-model");
    let (probes, profile) = sweep(&d, &cfg.replace("model = \"tiny\"", "model = \"nope\""));
    assert_eq!(probes.len(), 1);
    let e = profile["configs"][0]["error"].as_str().unwrap();
    assert!(
        e.contains("HTTP 404") && e.contains("model_not_found"),
        "{e}"
    );
}

#[test]
fn a_server_that_dies_is_a_data_point() {
    let d = out_dir("crash");
    // The server is killed 1 s after it answers /health (however long it
    // takes to start): probes see it die, the harness restarts it, and gives
    // the configuration up after 3 restarts. Without curl: 5 s after start.
    let cfg = format!(
        r#"[target]
kind = "launch"
model = "tiny"
vocab_size = 256
command = "sh -c '{} serve --model dummy:tiny --served-model-name {{model}} --port {{port}} & p=$!; if command -v curl >/dev/null; then until curl -sf -o /dev/null http://127.0.0.1:{{port}}/health; do sleep 0.1; done; else sleep 4; fi; sleep 1; kill -9 $p'"
ready_timeout_s = 60
[matrix]
batch_policies = ["continuous"]
buckets = ["16x512"]
concurrency_max = 4
[load]
rounds = 4
[slo]
e2e_p99_ms = 60000
"#,
        bin()
    );
    let (probes, profile) = sweep(&d, &cfg);
    let c = &profile["configs"][0];
    assert!(
        probes
            .iter()
            .any(|p| p["probe"]["breaches"].as_str().unwrap().contains("crash")),
        "a probe records the crash"
    );
    // The sweep went on to write its profile: the crash binds, or the
    // configuration was given up after the restarts, saying why.
    let gave_up = c["error"].as_str().unwrap_or("").contains("died");
    assert!(
        gave_up || c["buckets"][0]["binding_constraint"] == "crash",
        "{c}"
    );
    assert!(std::fs::read_dir(d.join("out/logs")).unwrap().count() >= 2);
}
