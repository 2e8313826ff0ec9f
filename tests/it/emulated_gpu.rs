//! The engine's CUDA backend, whole, on a machine without a GPU: the
//! envelope binary runs with the fake CUDA driver of `envelope_cuda::emu`
//! (`libcuda.so.1` on `LD_LIBRARY_PATH`) that executes every launch on the
//! CPU-emulated kernels. So cudarc, the runtime's kernel argument lists,
//! the model's forward on the device, paged KV, sampling on the device and
//! CUDA graph capture and replay all run, and are compared with the CPU
//! engine, in CI. Speed means nothing here; `scripts/device-check.sh` on a
//! real GPU is still the judge.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn emulator_env() -> Vec<(String, String)> {
    let emu = envelope_cuda::emu::Emulator::build(None).expect("a C++ compiler (g++)");
    assert!(
        emu.built.iter().all(|b| b.error.is_none()),
        "{:?}",
        emu.built
    );
    emu.env().expect("the fake CUDA driver builds")
}

fn envelope(args: &[&str], env: &[(String, String)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_envelope"));
    c.args(args)
        .env("ENVELOPE_LOG", "warn")
        .env_remove("ENVELOPE_DEVICE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// What a run printed, stdout then stderr, for assertion messages.
fn printed(r: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr)
    )
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("envelope-emugpu-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The GPU model check (scripts/device-check.sh's `models` stage) on the
/// emulated GPU: last-token logits and 8 greedy tokens of the CUDA backend
/// against the CPU engine, in f32, bf16 and fp8. Through `--emulate`, which
/// builds the fake driver and runs the command again on it.
#[test]
fn model_check_passes_on_the_emulated_gpu() {
    let out = scratch("models");
    let r = envelope(
        &[
            "cuda-selftest",
            "--emulate",
            "--models",
            "--check-models",
            "dummy:tiny-hd32",
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let text = printed(&r);
    assert!(r.status.success(), "{text}");
    assert!(text.contains("emulated GPU: "), "{text}");
    let checks = json(&out.join("model-check.json"));
    let checks = checks.as_array().unwrap();
    assert_eq!(checks.len(), 3, "{text}");
    for c in checks {
        assert_eq!(c["passed"], true, "{c}");
        // f32 and bf16: every greedy token as the CPU's; fp8 (against the
        // CPU's emulation) passes on logits and the first token.
        if c["precision"] != "fp8" {
            assert_eq!(c["greedy_equal"], 8, "{c}");
        }
        // Sampled tokens (not one repeated token) equal with and without
        // graph replay.
        let sampled = c["sampled_graphs"].as_array().unwrap();
        assert_eq!(sampled.len(), 8, "{c}");
        assert_eq!(c["sampled_graphs"], c["sampled_eager"], "{c}");
        let distinct: std::collections::HashSet<_> =
            sampled.iter().map(|t| t.to_string()).collect();
        assert!(distinct.len() >= 3, "{c}");
        assert_eq!(c["runtime"]["gemm"], "kernels", "{c}");
        // The decode steps after the first replayed a captured graph.
        let backend = c["backend"].as_str().unwrap_or_default();
        assert!(backend.contains("envelope CPU emulator"), "{backend}");
        let replayed: usize = backend
            .split(" captured, ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(replayed >= 5, "{backend}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// bench-engine --device cuda through the whole engine (scheduler, paged KV,
/// device sampling, CUDA graphs) on the emulated GPU: it runs, says which
/// device, and decode steps replay captured graphs.
#[test]
fn the_engine_serves_decode_steps_from_cuda_graphs_on_the_emulated_gpu() {
    let env = emulator_env();
    let r = envelope(
        &[
            "bench-engine",
            "--device",
            "cuda",
            "--model",
            "dummy:tiny-hd32",
            "--precision",
            "bf16",
            "--prompt-tokens",
            "24",
            "--decode-tokens",
            "6",
            "--decode-prompt-tokens",
            "8",
            "--concurrency",
            "1,3",
            "--kv-cache-bytes",
            "8MiB",
            "--json",
        ],
        &env,
    );
    let (out, err) = (
        String::from_utf8_lossy(&r.stdout),
        String::from_utf8_lossy(&r.stderr),
    );
    assert!(r.status.success(), "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let backend = report["backend"].as_str().unwrap_or_default();
    assert!(backend.contains("envelope CPU emulator"), "{backend}");
    assert!(backend.contains("CUDA graphs: enabled"), "{backend}");
}

/// scripts/device-check.sh's `kernels` stage, as it will run on a GPU
/// machine, on the emulated GPU: the self-test through cudarc (module load,
/// launches, copies) passes every case, and the stage and the script pass.
#[test]
fn device_check_kernels_stage_passes_on_the_emulated_gpu() {
    let env = emulator_env();
    let out = scratch("device-check");
    let mut c = Command::new("bash");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/device-check.sh"
    ))
    .arg(&out)
    .arg("kernels")
    // The emulator's speed is the host's: a stage limit sized for a GPU
    // (kernel-cache 30 s) fails a slower CI machine, so none applies.
    .env("DEVICE_CHECK_STAGE_LIMITS", "off")
    .env("ENVELOPE_BIN", env!("CARGO_BIN_EXE_envelope"))
    .env("ENVELOPE_LOG", "warn")
    .env_remove("ENVELOPE_DEVICE");
    for (k, v) in &env {
        c.env(k, v);
    }
    let r = c.output().unwrap();
    let log = std::fs::read_to_string(out.join("device-check.log")).unwrap_or_default();
    assert_eq!(r.status.code(), Some(0), "{log}");
    assert!(log.contains("envelope CPU emulator"), "{log}");
    assert!(log.contains("== kernel-cache (no limit)"), "{log}");
    let rep = json(&out.join("selftest.json"));
    assert_eq!(rep["failed"], 0, "{rep}");
    assert!(rep["passed"].as_u64().unwrap() >= 120, "{rep}");
    assert!(rep["device"]["name"].as_str().unwrap().contains("emulator"));
    let _ = std::fs::remove_dir_all(&out);
}

/// `cuda-selftest --bench` (device-check's `bench` stage) end to end on the
/// emulated GPU at toy sizes: every point is measured (prefill, eager
/// decode, decode from graphs that were captured and replayed), the weight
/// bytes match the analytic size, and JSON and CSV are written. The
/// figures themselves mean nothing here.
#[test]
fn bench_stage_runs_on_the_emulated_gpu() {
    let env = emulator_env();
    let out = scratch("bench");
    let r = envelope(
        &[
            "cuda-selftest",
            "--bench",
            "--bench-model",
            "dummy:tiny-hd32",
            "--bench-batches",
            "1,2",
            "--bench-contexts",
            "40",
            "--out",
            out.to_str().unwrap(),
        ],
        &env,
    );
    let text = printed(&r);
    assert!(r.status.success(), "{text}");
    let runs = json(&out.join("bench-cuda.json"));
    let runs = runs.as_array().unwrap();
    assert_eq!(runs.len(), 2, "bf16 and fp8: {text}");
    for run in runs {
        assert!(run["error"].is_null(), "{run}");
        // Exactly the analytic size, plus one f32 scale per fp8 matrix (2
        // layers x 7 projections).
        let extra =
            run["weight_bytes"].as_u64().unwrap() - run["weight_bytes_analytic"].as_u64().unwrap();
        let scales = if run["precision"] == "fp8" {
            2 * 7 * 4
        } else {
            0
        };
        assert_eq!(extra, scales, "{run}");
        let points = run["points"].as_array().unwrap();
        // 2 batches x (prefill, decode, decode-graphs).
        assert_eq!(points.len(), 6, "{run}");
        for p in points {
            assert!(p["tok_per_s"].as_f64().unwrap() > 0.0, "{p}");
            if p["phase"] == "decode-graphs" {
                let note = p["note"].as_str().unwrap();
                assert!(
                    note.contains("graph replays") && !note.contains(" 0 graph replays"),
                    "{note}"
                );
            }
        }
    }
    let csv = std::fs::read_to_string(out.join("bench-cuda.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 12, "{csv}");
    let _ = std::fs::remove_dir_all(&out);
}
