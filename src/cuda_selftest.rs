//! `envelope cuda-selftest --out DIR` (hidden; run by scripts/device-check.sh
//! on a GPU machine): device and NVML facts, NVRTC compile of every kernel,
//! each kernel against its CPU reference; `DIR/selftest.json`. Exits 1
//! unless everything passed.

use crate::cli::CudaSelftestArgs;
use anyhow::{bail, Result};

pub fn run(args: &CudaSelftestArgs) -> Result<()> {
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
    println!(
        "NVRTC: {} {}",
        rep.nvrtc.as_deref().unwrap_or("-"),
        rep.nvrtc_version.as_deref().unwrap_or("")
    );
    if let Some(e) = &rep.nvrtc_error {
        println!("NVRTC unavailable: {e}");
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
