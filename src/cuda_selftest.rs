//! `envelope cuda-selftest --out DIR` (hidden; run by scripts/device-check.sh
//! on a GPU machine): device and NVML facts, every kernel compiled by NVRTC
//! (or the PTX embedded in the binary),
//! each kernel against its CPU reference; `DIR/selftest.json`. Exits 1
//! unless everything passed. `--models`: whole dummy models on the GPU
//! against the CPU engine (`DIR/model-check.json`); `--bench`: tokens/s of
//! a model on the GPU (`DIR/bench-cuda.json` and `.csv`); `--gemm-bench`:
//! cuBLAS against the GEMM kernels (`DIR/gemm-bench.json` and `.csv`).
//! `--emulate`: any of these on the CPU-emulated GPU (the fake CUDA driver
//! of `envelope_cuda::emu`), in a child process.

use crate::cli::CudaSelftestArgs;
use anyhow::{bail, Context, Result};
use envelope_engine::cuda_check;
use envelope_engine::{KvDtype, Precision};

pub fn run(args: &CudaSelftestArgs) -> Result<()> {
    if args.emulate {
        return emulate();
    }
    if args.models {
        return models(args);
    }
    if args.bench {
        return bench(args);
    }
    if args.gemm_bench {
        return gemm_bench(args);
    }
    let nvml = match envelope_telemetry::Nvml::init() {
        Ok(n) => serde_json::json!({
            "driver_version": n.driver_version(),
            "cuda_driver_version": n.cuda_driver_version(),
            "device_count": n.device_count(),
            "gpu": n.info(args.ordinal as u32),
            "sample": n.sample(args.ordinal as u32, None),
        }),
        Err(e) => serde_json::json!({ "unavailable": e.to_string() }),
    };
    println!("NVML: {nvml}");
    let rep =
        envelope_cuda::selftest::run(args.ordinal, &args.out, serde_json::json!({ "nvml": nvml }));
    match (&rep.device, &rep.device_error) {
        (Some(d), _) => println!(
            "device {}: {} (compute capability {}.{}, {} SMs, {:.1} GiB, driver CUDA {})",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.multiprocessors,
            d.total_memory_bytes as f64 / (1u64 << 30) as f64,
            d.driver_cuda_version
        ),
        (None, Some(e)) => println!("device: {e}"),
        (None, None) => {}
    }
    print_report(&rep, args)
}

/// Set in the run `--emulate` starts, which must not start another.
const EMULATED_RUN: &str = "ENVELOPE_CUDA_SELFTEST_EMULATED";

/// `--emulate`: builds the CPU-emulated kernels and the fake CUDA driver
/// (`envelope_cuda::emu`), then runs this command again, without
/// `--emulate`, in a process whose environment puts that driver first (the
/// dynamic loader reads `LD_LIBRARY_PATH` only when a process starts). So
/// the run goes through cudarc and the runtime exactly as on a GPU.
fn emulate() -> Result<()> {
    if std::env::var_os(EMULATED_RUN).is_some() {
        bail!("--emulate inside an emulated run");
    }
    let emu =
        envelope_cuda::emu::Emulator::build(None).context("building the CPU-emulated kernels")?;
    for b in emu.built.iter().filter(|b| b.error.is_some()) {
        println!(
            "emulator: {} did not build: {}",
            b.file,
            b.error.as_deref().unwrap_or_default()
        );
    }
    let env = emu.env().context("building the fake CUDA driver")?;
    println!(
        "emulated GPU: {}, kernels and driver in {}",
        emu.compiler,
        emu.dir.display()
    );
    let exe = std::env::current_exe().context("finding this binary")?;
    let args: Vec<std::ffi::OsString> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--emulate")
        .collect();
    let status = std::process::Command::new(&exe)
        .args(&args)
        .envs(env)
        .env(EMULATED_RUN, "1")
        .status()
        .with_context(|| format!("running {}", exe.display()))?;
    if !status.success() {
        bail!("the run on the emulated GPU did not pass ({status})");
    }
    Ok(())
}

/// The self-test's compile and case table, and its verdict.
fn print_report(rep: &envelope_cuda::selftest::Report, args: &CudaSelftestArgs) -> Result<()> {
    if let Some(e) = &rep.emulated {
        println!("emulated: {e}");
    }
    println!("kernels: {}", rep.kernels.as_deref().unwrap_or("-"));
    if let Some(e) = &rep.kernels_error {
        println!("kernels unavailable: {e}");
    }
    println!("cuBLAS: {}", rep.cublas.as_deref().unwrap_or("-"));
    for w in &rep.warnings {
        println!("WARNING: {w}");
    }
    for c in &rep.compile {
        println!(
            "compile {:<22} {:>6.2} s {:>7} bytes{}{}",
            c.file,
            c.seconds,
            c.ptx_bytes,
            if c.from_cache { " (cache)" } else { "" },
            c.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        );
    }
    println!(
        "{:<6} {:<36} {:<5} {:>12} {:>10}  case",
        "result", "entry", "dtype", "max_abs_err", "err/tol"
    );
    for c in &rep.cases {
        println!(
            "{:<6} {:<36} {:<5} {:>12.3e} {:>10.3}  {}{}{}",
            if c.passed { "ok" } else { "FAIL" },
            c.entry,
            format!("{:?}", c.dtype).to_lowercase(),
            c.max_abs_err,
            c.max_err_over_tol,
            c.case,
            c.note
                .as_deref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default(),
            c.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        );
    }
    println!(
        "{} passed, {} failed; wrote {}",
        rep.passed,
        rep.failed,
        args.out.join("selftest.json").display()
    );
    if !rep.ok() {
        bail!("the CUDA self-test did not pass (see above)");
    }
    Ok(())
}

fn write_json(path: &std::path::Path, v: &impl serde::Serialize) -> Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(v)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// A CSV file written row by row through the csv crate (which quotes a
/// field holding a comma, quote or line break), each row flushed as it is
/// written, so a run killed part-way leaves every row it finished.
struct CsvOut {
    path: std::path::PathBuf,
    w: csv::Writer<std::fs::File>,
    error: Option<csv::Error>,
}

impl CsvOut {
    fn create(path: &std::path::Path, header: &[&str]) -> Result<Self> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let w =
            csv::Writer::from_path(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = CsvOut {
            path: path.to_path_buf(),
            w,
            error: None,
        };
        out.row(header);
        Ok(out)
    }

    /// Appends one row; the first write error is kept for `finish`.
    fn row<T: AsRef<[u8]>>(&mut self, fields: impl IntoIterator<Item = T>) {
        if self.error.is_none() {
            let written = self.w.write_record(fields);
            if let Err(e) = written.and_then(|()| self.w.flush().map_err(csv::Error::from)) {
                self.error = Some(e);
            }
        }
    }

    fn finish(self) -> Result<()> {
        match self.error {
            Some(e) => Err(e).with_context(|| format!("writing {}", self.path.display())),
            None => Ok(()),
        }
    }
}

fn models(args: &CudaSelftestArgs) -> Result<()> {
    let mut all = Vec::new();
    println!(
        "{:<6} {:<24} {:<5} {:>12} {:>10} {:>9} {:>6} {:>8}  greedy cpu | gpu",
        "result", "model", "prec", "max_abs", "rel_max", "cosine", "top1=", "equal"
    );
    for spec in &args.check_models {
        for (p, kv) in [
            (Precision::F32, KvDtype::F32),
            (Precision::Bf16, KvDtype::Bf16),
            (Precision::Fp8, KvDtype::Bf16),
        ] {
            let r = cuda_check::model_check(spec, p, kv, args.ordinal, 24, 8);
            let (abs, rel, cos, top) =
                r.logits.map_or((f32::NAN, f32::NAN, f32::NAN, false), |d| {
                    (
                        d.max_abs_diff,
                        d.rel_to_max,
                        d.cosine,
                        d.top1_cpu == d.top1_gpu,
                    )
                });
            println!(
                "{:<6} {:<24} {:<5} {:>12.3e} {:>10.3e} {:>9.5} {:>6} {:>5}/{:<2}  {:?} | {:?}{}",
                if r.passed { "ok" } else { "FAIL" },
                spec,
                p.as_str(),
                abs,
                rel,
                cos,
                top,
                r.greedy_equal,
                r.greedy_cpu.len(),
                r.greedy_cpu,
                r.greedy_gpu,
                r.error
                    .as_deref()
                    .map(|e| format!(" ERROR {e}"))
                    .unwrap_or_default()
            );
            all.push(r);
        }
    }
    let path = args.out.join("model-check.json");
    write_json(&path, &all)?;
    println!("wrote {}", path.display());
    if all.iter().any(|r| !r.passed) {
        bail!("a model check did not pass (see above)");
    }
    Ok(())
}

fn gemm_bench(args: &CudaSelftestArgs) -> Result<()> {
    use envelope_cuda::gemm_bench::{run, LLAMA_8B};
    let gpu = envelope_cuda::runtime::Gpu::open(args.ordinal)
        .with_context(|| format!("opening CUDA device {}", args.ordinal))?;
    gpu.bind()?;
    println!(
        "{} ({}), kernels: {}, GEMMs: {}",
        gpu.device.info.name, gpu.info.arch, gpu.info.kernels, gpu.info.gemm
    );
    let mut csv = CsvOut::create(
        &args.out.join("gemm-bench.csv"),
        &[
            "shape",
            "dtype",
            "path",
            "rows",
            "inner",
            "out",
            "calls",
            "us_per_call",
            "tflops",
            "weight_gb_per_s",
            "error",
        ],
    )?;
    println!(
        "{:<8} {:<5} {:<8} {:>5} {:>6} {:>7} {:>11} {:>8} {:>9}",
        "shape", "dtype", "path", "rows", "inner", "out", "us/call", "TFLOP/s", "W GB/s"
    );
    let points = run(&gpu, &LLAMA_8B, &[1, 8, 64, 512, 4096], |p| {
        println!(
            "{:<8} {:<5} {:<8} {:>5} {:>6} {:>7} {:>11.1} {:>8.1} {:>9.0}{}",
            p.shape,
            p.dtype,
            p.path,
            p.rows,
            p.inner,
            p.out,
            p.us_per_call,
            p.tflops,
            p.weight_gb_per_s,
            p.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        );
        csv.row([
            p.shape.to_string(),
            p.dtype.to_string(),
            p.path.to_string(),
            p.rows.to_string(),
            p.inner.to_string(),
            p.out.to_string(),
            p.calls.to_string(),
            format!("{:.2}", p.us_per_call),
            format!("{:.3}", p.tflops),
            format!("{:.1}", p.weight_gb_per_s),
            p.error.clone().unwrap_or_default(),
        ]);
    });
    csv.finish()?;
    write_json(
        &args.out.join("gemm-bench.json"),
        &serde_json::json!({ "device": gpu.device.info, "runtime": gpu.info, "points": points }),
    )?;
    println!("wrote {}/gemm-bench.json and .csv", args.out.display());
    if points.iter().any(|p| p.error.is_some()) {
        bail!("a GEMM point failed (see above)");
    }
    Ok(())
}

fn bench(args: &CudaSelftestArgs) -> Result<()> {
    let nvml = envelope_telemetry::Nvml::init().ok();
    let ordinal = args.ordinal as u32;
    let used = || {
        nvml.as_ref()
            .and_then(|n| n.sample(ordinal, None).memory_used_bytes)
    };
    let mut runs = Vec::new();
    let mut csv = CsvOut::create(
        &args.out.join("bench-cuda.csv"),
        &[
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
        ],
    )?;
    println!(
        "{:<22} {:<5} {:<13} {:>5} {:>6} {:>12} {:>10}",
        "model", "prec", "phase", "batch", "ctx", "tok/s", "ms/step"
    );
    let json = args.out.join("bench-cuda.json");
    for p in [Precision::Bf16, Precision::Fp8] {
        let r = cuda_check::bench(
            &args.bench_model,
            p,
            KvDtype::Bf16,
            args.ordinal,
            &args.bench_batches,
            &args.bench_contexts,
            8,
            16_384,
            &used,
            &mut |q| {
                println!(
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
                );
                csv.row([
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
                ]);
            },
        );
        println!(
            "{} {}: weights {:.2} GiB (analytic {:.2} GiB, NVML +{:.2} GiB), loaded in {:.1} s{}",
            r.model,
            p,
            r.weight_bytes as f64 / (1u64 << 30) as f64,
            r.weight_bytes_analytic as f64 / (1u64 << 30) as f64,
            r.device_bytes_used_by_load.unwrap_or(0) as f64 / (1u64 << 30) as f64,
            r.load_seconds,
            r.error
                .as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        );
        runs.push(r);
        // After each precision, so a run stopped in the second keeps the first.
        write_json(&json, &runs)?;
    }
    csv.finish()?;
    println!("wrote {} and bench-cuda.csv", json.display());
    if runs.iter().any(|r| r.error.is_some()) {
        bail!("a bench run failed (see above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_are_on_disk_as_soon_as_they_are_written() {
        let dir = std::env::temp_dir().join(format!("envelope-csvout-{}", std::process::id()));
        let path = dir.join("sub/points.csv");
        let mut csv = CsvOut::create(&path, &["a", "b"]).unwrap();
        csv.row(["1", "x, \"y\"\nz"]);
        let read = || -> Vec<Vec<String>> {
            csv::Reader::from_path(&path)
                .unwrap()
                .records()
                .map(|r| r.unwrap().iter().map(str::to_string).collect())
                .collect()
        };
        // Read before finish (as after a kill): the row is there, whole,
        // its comma, quotes and line break inside the one field.
        assert_eq!(read(), vec![vec!["1", "x, \"y\"\nz"]]);
        csv.row(["2", "w"]);
        csv.finish().unwrap();
        assert_eq!(read(), vec![vec!["1", "x, \"y\"\nz"], vec!["2", "w"]]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
