//! Telemetry against the real binary: `envelope probe --json` on this
//! machine, and the metrics adapter on `envelope serve`'s live `/metrics`
//! under load.

use crate::common;

use common::{smollm2, Server};
use envelope_telemetry::{fetch_engine_state, EngineKind};
use serde_json::{json, Value};
use std::time::Duration;

#[test]
fn probe_json_reports_its_source() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["probe", "--json", "--model", "dummy:tiny@3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let source = v["node"]["source"].as_str().unwrap();
    assert_eq!(v["sample"]["source"], v["node"]["source"]);
    if source == "host" {
        // No NVIDIA driver here (CI): the host fallback, and why.
        assert!(v["node"]["nvml_unavailable"]
            .as_str()
            .is_some_and(|s| !s.is_empty()));
        assert_eq!(v["node"]["gpus"], json!([]));
    } else {
        assert_eq!(source, "nvml");
        assert!(!v["node"]["gpus"].as_array().unwrap().is_empty());
    }
    assert!(v["sample"]["host"]["process_rss_bytes"].as_u64().unwrap() > 0);
    assert!(v["sample"]["host"]["mem_available_bytes"].as_u64().unwrap() > 0);
    assert!(v["sample"]["unix_ms"].as_u64().unwrap() > 1_700_000_000_000);
    assert_eq!(
        v["model"],
        json!({"kind": "dummy", "preset": "tiny", "seed": 3})
    );
    assert_eq!(v["engine"]["name"], "envelope");
    assert_eq!(v["server"], Value::Null);
}

#[test]
fn probe_names_an_unreachable_server() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envelope"))
        .args(["probe", "--json", "--server", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v["server"]["error"]
            .as_str()
            .unwrap()
            .contains("127.0.0.1:1"),
        "{v}"
    );
}

#[tokio::test]
async fn engine_state_of_envelope_serve_under_load() {
    let s = Server::start(&[
        "--model",
        &smollm2(),
        "--kv-cache-bytes",
        "64MiB",
        "--max-num-seqs",
        "4",
    ]);
    let url = s.url("/metrics");
    let idle = fetch_engine_state(&url, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(idle.engine, EngineKind::Envelope);
    assert_eq!(
        (idle.running, idle.waiting, idle.kv_usage),
        (Some(0.0), Some(0.0), Some(0.0))
    );
    assert_eq!(idle.generation_tokens_total, Some(0.0));
    // Six long requests against max-num-seqs 4: some run, some wait.
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let u = s.url("/v1/completions");
            tokio::spawn(async move {
                let body = json!({"prompt": format!("Story number {i}:"), "max_tokens": 120, "ignore_eos": true, "temperature": 0});
                reqwest::Client::new().post(u).json(&body).send().await.unwrap().json::<Value>().await.unwrap()
            })
        })
        .collect();
    let mut busy = None;
    for _ in 0..200 {
        let st = fetch_engine_state(&url, Duration::from_secs(5))
            .await
            .unwrap();
        if st.running == Some(4.0) && st.waiting == Some(2.0) {
            busy = Some(st);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let busy = busy.expect("saw 4 running and 2 waiting");
    assert!(busy.kv_usage.unwrap() > 0.0 && busy.kv_usage.unwrap() <= 1.0);
    assert!(busy.age_ms() < 5_000);
    for t in tasks {
        assert_eq!(t.await.unwrap()["usage"]["completion_tokens"], 120);
    }
    let done = fetch_engine_state(&url, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(done.running, Some(0.0));
    assert_eq!(done.kv_usage, Some(0.0));
    assert_eq!(done.generation_tokens_total, Some(720.0));
    assert!(done.prompt_tokens_total.unwrap() >= 6.0 * 4.0);
    assert_eq!(done.preemptions_total, Some(0.0));
}
