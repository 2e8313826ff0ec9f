//! The GPU self-test behind `envelope cuda-selftest` (and
//! `scripts/device-check.sh`): open the device through [`crate::runtime`]
//! (every kernel compiled with the machine's NVRTC, or the embedded PTX:
//! [`crate::embedded`]), run each kernel through the runtime's own typed
//! methods, the GEMM kernels included, on seeded random inputs, compare it
//! with [`crate::reference`], and write `selftest.json`. So the argument
//! lists the engine launches with are what is checked, not a copy of them.
//! It has never run on a GPU at the time of writing (no GPU was lent). In
//! CI the same cases run on the fake CUDA driver of [`crate::emu`] (every
//! launch on the CPU-emulated kernels: `envelope cuda-selftest --emulate`,
//! `tests/it/kernel_emu.rs`); the CPU side of it (the references, the
//! comparison, the dtype rounding) is unit-tested here.
//!
//! The case groups: `elementwise` (the layer operations), `gemm`
//! (`kernels/gemm.cu`), `support` (dummy weights, fp8 quantisation, bias),
//! `attention` (the paged cache and both attention kernels), `sampling`;
//! `check` judges them.

use crate::device::{Device, DeviceInfo};
use crate::embedded::GemmChoice;
use crate::error::{guarded, CudaError};
use crate::rng::Rng;
use crate::runtime::{DType, Gpu, KernelFile, OpenOptions};
use check::Cx;
use serde::Serialize;
use std::path::Path;

mod attention;
mod check;
mod elementwise;
mod gemm;
mod sampling;
mod support;

pub use crate::embedded::version_warning;
pub use check::{compare, round, tolerance, Tol};
pub use elementwise::random_q_blocks;

#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: String,
    pub entry: String,
    pub dtype: DType,
    pub tolerance: Tol,
    pub elements: usize,
    pub max_abs_err: f32,
    /// Worst error over its tolerance: passes at <= 1.
    pub max_err_over_tol: f32,
    pub passed: bool,
    pub note: Option<String>,
    pub error: Option<String>,
}

/// One kernel file's compile and load, as the runtime recorded it.
pub type CompileResult = KernelFile;

#[derive(Debug, Clone, Serialize, Default)]
pub struct Report {
    pub device: Option<DeviceInfo>,
    pub device_error: Option<String>,
    /// Where the kernels came from (NVRTC or the embedded PTX).
    pub kernels: Option<String>,
    /// Why no kernel could load.
    pub kernels_error: Option<String>,
    pub nvrtc: Option<String>,
    pub nvrtc_version: Option<String>,
    pub include_dir: Option<String>,
    pub arch: Option<String>,
    pub cublas: Option<String>,
    pub compile: Vec<CompileResult>,
    pub cases: Vec<CaseResult>,
    pub passed: usize,
    pub failed: usize,
    pub warnings: Vec<String>,
    /// Set when the device is the fake CUDA driver of [`crate::emu`]: the
    /// cases ran on the CPU-emulated kernels.
    pub emulated: Option<String>,
    /// Free-form facts the caller adds (NVML readings).
    pub extra: serde_json::Value,
}

impl Report {
    /// The device, or why there is none: one line.
    pub fn device_line(&self) -> Option<String> {
        match (&self.device, &self.device_error) {
            (Some(d), _) => Some(format!(
                "device {}: {} (compute capability {}.{}, {} SMs, {:.1} GiB, driver CUDA {})",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.multiprocessors,
                d.total_memory_bytes as f64 / (1u64 << 30) as f64,
                d.driver_cuda_version
            )),
            (None, Some(e)) => Some(format!("device: {e}")),
            (None, None) => None,
        }
    }

    /// Where the kernels came from, each compile and each case against
    /// its CPU reference, and the count.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let error = |e: &Option<String>| {
            e.as_deref()
                .map(|e| format!(" ERROR {e}"))
                .unwrap_or_default()
        };
        if let Some(e) = &self.emulated {
            let _ = writeln!(o, "emulated: {e}");
        }
        let _ = writeln!(o, "kernels: {}", self.kernels.as_deref().unwrap_or("-"));
        if let Some(e) = &self.kernels_error {
            let _ = writeln!(o, "kernels unavailable: {e}");
        }
        let _ = writeln!(o, "cuBLAS: {}", self.cublas.as_deref().unwrap_or("-"));
        for w in &self.warnings {
            let _ = writeln!(o, "WARNING: {w}");
        }
        for c in &self.compile {
            let _ = writeln!(
                o,
                "compile {:<22} {:>6.2} s {:>7} bytes{}{}",
                c.file,
                c.seconds,
                c.ptx_bytes,
                if c.from_cache { " (cache)" } else { "" },
                error(&c.error)
            );
        }
        let _ = writeln!(
            o,
            "{:<6} {:<36} {:<5} {:>12} {:>10}  case",
            "result", "entry", "dtype", "max_abs_err", "err/tol"
        );
        for c in &self.cases {
            let _ = writeln!(
                o,
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
                error(&c.error)
            );
        }
        let _ = writeln!(o, "{} passed, {} failed", self.passed, self.failed);
        o
    }

    pub fn ok(&self) -> bool {
        self.device.is_some()
            && self.kernels_error.is_none()
            && self.failed == 0
            && self.passed > 0
            && self.compile.iter().all(|c| c.error.is_none())
    }
}

/// Runs the whole self-test on device `ordinal` and writes
/// `out_dir/selftest.json`. Each stage's failure is recorded, not fatal: a
/// kernel file that does not compile or load is in [`Report::compile`], and
/// only the cases of its entries fail.
pub fn run(ordinal: usize, out_dir: &Path, extra: serde_json::Value) -> Report {
    let mut rep = Report {
        extra,
        ..Report::default()
    };
    let device = match Device::open(ordinal) {
        Ok(d) => d,
        Err(e) => {
            rep.device_error = Some(e.to_string());
            write(out_dir, &rep);
            return rep;
        }
    };
    rep.device = Some(device.info.clone());
    rep.arch = Some(device.arch());
    if device.info.name.starts_with(crate::emu::DEVICE_NAME) {
        rep.emulated = Some(format!(
            "the fake CUDA driver of kernels/emu (every launch on the CPU-emulated kernels{})",
            std::env::var("ENVELOPE_EMU_DIR")
                .map(|d| format!(" in {d}"))
                .unwrap_or_default()
        ));
    }
    let gemm = match GemmChoice::from_env() {
        Ok(g) => g,
        Err(e) => {
            rep.kernels_error = Some(e.to_string());
            write(out_dir, &rep);
            return rep;
        }
    };
    rep.cublas = Some(probe_cublas(&device, gemm, &mut rep.warnings));
    // The GEMM cases run kernels/gemm.cu's entries (`gemm_kernels`), so the
    // runtime opens no cuBLAS handle of its own: the probe above reports it.
    let opts = OpenOptions {
        keep_going: true,
        gemm: Some(GemmChoice::Kernels),
    };
    let gpu = match Gpu::open_device(device, opts) {
        Ok(g) => g,
        Err(e) => {
            rep.kernels_error = Some(format!("{e} (no kernel can load, so none ran)"));
            write(out_dir, &rep);
            return rep;
        }
    };
    rep.device = Some(gpu.device.info.clone());
    rep.kernels = Some(gpu.info.kernels.clone());
    rep.nvrtc_version = Some(gpu.info.nvrtc_version.clone());
    rep.nvrtc = gpu.device.info.libraries.nvrtc.clone();
    rep.include_dir = gpu.info.include_dir.clone();
    rep.warnings.extend(gpu.info.fallbacks.iter().cloned());
    rep.compile = gpu.info.kernel_files.clone();
    rep.cases = run_cases(&gpu);
    rep.passed = rep.cases.iter().filter(|c| c.passed).count();
    rep.failed = rep.cases.len() - rep.passed;
    write(out_dir, &rep);
    rep
}

/// Whether cuBLAS would open on this device (a handle created and dropped),
/// as the engine's `ENVELOPE_GEMM` setting would have it.
fn probe_cublas(device: &Device, gemm: GemmChoice, warnings: &mut Vec<String>) -> String {
    if gemm == GemmChoice::Kernels {
        return "not opened (ENVELOPE_GEMM=kernels: GEMMs on kernels/gemm.cu)".into();
    }
    let opened = crate::libs::probe(crate::libs::CudaLib::CublasLt)
        .and_then(|_| crate::libs::probe(crate::libs::CudaLib::Cublas))
        .and_then(|p| {
            guarded("cublasCreate", || {
                cudarc::cublas::CudaBlas::new(device.ctx.default_stream())
            })?
            .map(|_| p)
            .map_err(|e| CudaError::Driver {
                call: "cublasCreate",
                message: format!("{e:?}"),
            })
        });
    match opened {
        Ok(p) => format!("ok: handle created ({p})"),
        Err(e) if gemm == GemmChoice::Cublas => {
            warnings.push(format!(
                "ENVELOPE_GEMM=cublas but cuBLAS is unavailable: the engine would refuse to start ({e})"
            ));
            format!("unavailable: {e}")
        }
        Err(e) => format!("unavailable: {e} (GEMMs would run on kernels/gemm.cu)"),
    }
}

/// Every case group, each failure recorded (a panic too), none fatal.
fn run_cases(gpu: &Gpu) -> Vec<CaseResult> {
    let mut cx = Cx {
        gpu,
        rng: Rng::new(0x5EED_0007),
        out: Vec::new(),
    };
    type CaseFn = fn(&mut Cx);
    let groups: [(&str, CaseFn); 5] = [
        ("elementwise", elementwise::cases),
        ("gemm", gemm::cases),
        ("model support", support::cases),
        ("attention", attention::cases),
        ("sampling", sampling::cases),
    ];
    for (name, f) in groups {
        if let Err(e) = guarded("self-test cases", || f(&mut cx)) {
            cx.out.push(CaseResult {
                case: format!("{name} (aborted)"),
                entry: String::new(),
                dtype: DType::F32,
                tolerance: tolerance(DType::F32),
                elements: 0,
                max_abs_err: f32::NAN,
                max_err_over_tol: f32::NAN,
                passed: false,
                note: None,
                error: Some(e.to_string()),
            });
        }
    }
    cx.out
}

fn write(out_dir: &Path, rep: &Report) {
    let _ = std::fs::create_dir_all(out_dir);
    if let Ok(text) = serde_json::to_string_pretty(rep) {
        let _ = std::fs::write(out_dir.join("selftest.json"), text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_when_nvrtc_is_newer_than_the_driver() {
        assert!(version_warning((13, 0), "13.0").is_none());
        assert!(version_warning((12, 8), "13.0").is_none());
        assert!(version_warning((13, 1), "13.0").unwrap().contains("newer"));
    }

    /// The whole self-test on this machine: without a driver it writes a
    /// report that says why, and does not panic.
    #[test]
    fn without_a_gpu_the_report_says_why() {
        let dir = std::env::temp_dir().join(format!("envelope-selftest-{}", std::process::id()));
        let rep = run(0, &dir, serde_json::json!({}));
        let text = std::fs::read_to_string(dir.join("selftest.json")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        if rep.device.is_none() {
            assert!(!rep.ok());
            assert!(text.contains("libcuda.so"), "{text}");
        }
    }
}
