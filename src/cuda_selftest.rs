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
use envelope_cuda::outputs::{write_json, CsvOut};
use envelope_engine::cuda_report;

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
    if let Some(line) = rep.device_line() {
        println!("{line}");
    }
    print!("{}", rep.table());
    println!("wrote {}", args.out.join("selftest.json").display());
    if !rep.ok() {
        bail!("the CUDA self-test did not pass (see above)");
    }
    Ok(())
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

fn models(args: &CudaSelftestArgs) -> Result<()> {
    let passed = cuda_report::check_models(&args.check_models, args.ordinal, &args.out, &mut say)
        .with_context(|| format!("writing into {}", args.out.display()))?;
    if !passed {
        bail!("a model check did not pass (see above)");
    }
    Ok(())
}

fn gemm_bench(args: &CudaSelftestArgs) -> Result<()> {
    use envelope_cuda::gemm_bench::{run, GemmPoint, LLAMA_8B};
    let gpu = envelope_cuda::runtime::Gpu::open(args.ordinal)
        .with_context(|| format!("opening CUDA device {}", args.ordinal))?;
    gpu.bind()?;
    println!(
        "{} ({}), kernels: {}, GEMMs: {}",
        gpu.device.info.name, gpu.info.arch, gpu.info.kernels, gpu.info.gemm
    );
    let path = args.out.join("gemm-bench.csv");
    let mut csv = CsvOut::create(&path, &GemmPoint::CSV_HEADER)
        .with_context(|| format!("creating {}", path.display()))?;
    println!("{}", GemmPoint::header_line());
    let points = run(&gpu, &LLAMA_8B, &[1, 8, 64, 512, 4096], |p| {
        println!("{}", p.line());
        csv.row(p.csv_row());
    });
    csv.finish()?;
    let path = args.out.join("gemm-bench.json");
    let all =
        serde_json::json!({ "device": gpu.device.info, "runtime": gpu.info, "points": points });
    write_json(&path, &all).with_context(|| format!("writing {}", path.display()))?;
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
    let grid = cuda_report::BenchGrid {
        model: &args.bench_model,
        ordinal: args.ordinal,
        batches: &args.bench_batches,
        contexts: &args.bench_contexts,
    };
    let passed = cuda_report::bench_precisions(&grid, &args.out, &used, &mut say)
        .with_context(|| format!("writing into {}", args.out.display()))?;
    if !passed {
        bail!("a bench run failed (see above)");
    }
    Ok(())
}

/// Prints a line as it comes.
fn say(line: String) {
    println!("{line}");
}
