//! What `envelope cuda-selftest --models` and `--bench` run and write:
//! every model in each precision the checks cover, a printed line per
//! result, `model-check.json`, and `bench-cuda.json` with its CSV (both
//! rewritten as results come, so a run stopped part-way keeps what it
//! finished).

use crate::cuda_check::{bench, model_check, BenchPoint, BenchRun, ModelCheck};
use crate::precision::{KvDtype, Precision};
use envelope_cuda::outputs::{write_json, CsvOut};
use std::io;
use std::path::Path;

/// The precisions (weights, KV) a model check compares.
pub const CHECKED: [(Precision, KvDtype); 3] = [
    (Precision::F32, KvDtype::F32),
    (Precision::Bf16, KvDtype::Bf16),
    (Precision::Fp8, KvDtype::Bf16),
];

/// The precisions the GPU benchmark runs, each with a bf16 KV cache.
pub const BENCHED: [Precision; 2] = [Precision::Bf16, Precision::Fp8];

/// Checks every model of `specs` in every [`CHECKED`] precision on device
/// `ordinal` against the CPU engine, saying a line each (after a header),
/// and writes `out/model-check.json`. `Ok(false)` when a check failed.
pub fn check_models(
    specs: &[String],
    ordinal: usize,
    out: &Path,
    say: &mut dyn FnMut(String),
) -> io::Result<bool> {
    say(format!(
        "{:<6} {:<24} {:<5} {:>12} {:>10} {:>9} {:>6} {:>8}  greedy cpu | gpu",
        "result", "model", "prec", "max_abs", "rel_max", "cosine", "top1=", "equal"
    ));
    let mut all = Vec::new();
    for spec in specs {
        for (p, kv) in CHECKED {
            let r = model_check(spec, p, kv, ordinal, 24, 8);
            say(line_of_check(&r));
            all.push(r);
        }
    }
    let path = out.join("model-check.json");
    write_json(&path, &all)?;
    say(format!("wrote {}", path.display()));
    Ok(all.iter().all(|r| r.passed))
}

fn line_of_check(r: &ModelCheck) -> String {
    let (abs, rel, cos, top) =
        r.logits
            .as_ref()
            .map_or((f32::NAN, f32::NAN, f32::NAN, false), |d| {
                (
                    d.max_abs_diff,
                    d.rel_to_max,
                    d.cosine,
                    d.top1_cpu == d.top1_gpu,
                )
            });
    format!(
        "{:<6} {:<24} {:<5} {:>12.3e} {:>10.3e} {:>9.5} {:>6} {:>5}/{:<2}  {:?} | {:?}{}",
        if r.passed { "ok" } else { "FAIL" },
        r.model,
        r.precision.as_str(),
        abs,
        rel,
        cos,
        top,
        r.greedy_equal,
        r.greedy_cpu.len(),
        r.greedy_cpu,
        r.greedy_gpu,
        error(&r.error)
    )
}

fn error(e: &Option<String>) -> String {
    e.as_deref()
        .map(|e| format!(" ERROR {e}"))
        .unwrap_or_default()
}

/// The columns of `bench-cuda.csv`.
const BENCH_CSV: [&str; 10] = [
    "model",
    "precision",
    "phase",
    "batch",
    "context",
    "steps",
    "seconds",
    "tok_per_s",
    "ms_per_step",
    "note",
];

fn csv_row(q: &BenchPoint) -> [String; 10] {
    [
        q.model.to_string(),
        q.precision.as_str().to_string(),
        q.phase.to_string(),
        q.batch.to_string(),
        q.context.to_string(),
        q.steps.to_string(),
        format!("{:.6}", q.seconds),
        format!("{:.2}", q.tok_per_s),
        format!("{:.3}", q.ms_per_step),
        q.note.clone().unwrap_or_default(),
    ]
}

fn line_of_point(q: &BenchPoint) -> String {
    format!(
        "{:<22} {:<5} {:<13} {:>5} {:>6} {:>12.1} {:>10.2}{}",
        q.model,
        q.precision.as_str(),
        q.phase,
        q.batch,
        q.context,
        q.tok_per_s,
        q.ms_per_step,
        q.note
            .as_deref()
            .filter(|n| n.starts_with("skipped") || n.contains("graph"))
            .map(|n| format!("  {}", n.rsplit("; ").next().unwrap_or(n)))
            .unwrap_or_default()
    )
}

fn line_of_run(r: &BenchRun) -> String {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    format!(
        "{} {}: weights {:.2} GiB (analytic {:.2} GiB, NVML +{:.2} GiB), loaded in {:.1} s{}",
        r.model,
        r.precision,
        gib(r.weight_bytes as f64),
        gib(r.weight_bytes_analytic as f64),
        gib(r.device_bytes_used_by_load.unwrap_or(0) as f64),
        r.load_seconds,
        error(&r.error)
    )
}

/// What the GPU benchmark measures: a model at batch sizes and contexts.
pub struct BenchGrid<'a> {
    pub model: &'a str,
    pub ordinal: usize,
    pub batches: &'a [usize],
    pub contexts: &'a [usize],
}

/// Benchmarks `grid` in every [`BENCHED`] precision, saying a line per
/// point and per run, and writes `out/bench-cuda.json` (after each
/// precision) and `out/bench-cuda.csv` (after each point). `device_used`
/// reads the device's used memory (NVML). `Ok(false)` when a run failed.
pub fn bench_precisions(
    grid: &BenchGrid,
    out: &Path,
    device_used: &dyn Fn() -> Option<u64>,
    say: &mut dyn FnMut(String),
) -> io::Result<bool> {
    let mut csv = CsvOut::create(&out.join("bench-cuda.csv"), &BENCH_CSV)?;
    say(format!(
        "{:<22} {:<5} {:<13} {:>5} {:>6} {:>12} {:>10}",
        "model", "prec", "phase", "batch", "ctx", "tok/s", "ms/step"
    ));
    let json = out.join("bench-cuda.json");
    let mut runs = Vec::new();
    for p in BENCHED {
        let r = bench(
            grid.model,
            p,
            KvDtype::Bf16,
            grid.ordinal,
            grid.batches,
            grid.contexts,
            8,
            16_384,
            device_used,
            &mut |q| {
                say(line_of_point(q));
                csv.row(csv_row(q));
            },
        );
        say(line_of_run(&r));
        runs.push(r);
        // After each precision, so a run stopped in the second keeps the first.
        write_json(&json, &runs)?;
    }
    csv.finish()?;
    say(format!("wrote {} and bench-cuda.csv", json.display()));
    Ok(runs.iter().all(|r| r.error.is_none()))
}
