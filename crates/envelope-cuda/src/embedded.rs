//! Where the kernels' PTX comes from, and where the GEMMs run: the choices
//! that let the backend run on a machine with the NVIDIA driver and nothing
//! else (no CUDA toolkit, no pip wheels, no network).
//!
//! - Kernels: NVRTC at run time for the device's exact architecture, cached
//!   on disk ([`crate::compile`]), when NVRTC and the CUDA headers are
//!   there; otherwise the PTX embedded in the binary. `scripts/gen-ptx.sh`
//!   makes it with the pinned NVRTC 13.0 wheel for compute_80 and compute_90
//!   (`kernels/ptx/`); the driver JIT-compiles it for the GPU at load
//!   (compute_90 PTX runs on Hopper and newer, compute_80 on Ampere and Ada).
//!   `kernels/ptx/SOURCES` holds the SHA-256 of every source it was made
//!   from, checked by a unit test, and where NVRTC is installed the files
//!   must equal its output byte for byte (`tests/it/nvrtc_compile.rs`).
//! - GEMMs: cuBLAS / cuBLASLt when they load, otherwise the tensor-core
//!   kernels of `kernels/gemm.cu`.
//!
//! `ENVELOPE_KERNELS=auto|nvrtc|embedded` and `ENVELOPE_GEMM=auto|cublas|kernels`
//! force either side (`auto`, the default, prefers the toolkit's).

use crate::compile::{Compiled, Compiler};
use crate::error::{CudaError, Result};
use crate::kernels::{KernelSource, HEADERS, KERNELS};
use sha2::{Digest, Sha256};

/// The architectures PTX is embedded for, in [`KernelSource::ptx`] order.
pub const ARCHS: [&str; 2] = ["compute_80", "compute_90"];

/// The NVRTC that made the embedded PTX (`scripts/nvrtc-setup.sh`'s pin).
/// Its PTX ISA needs a driver that supports CUDA 13.0 (R580 or newer).
pub const NVRTC: (i32, i32) = (13, 0);

/// `kernels/ptx/SOURCES`: `<file> <sha256>` per line, `#` comments.
pub const SOURCES: &str = envelope_kernels::PTX_SOURCES;

/// The embedded architecture for a device of compute capability `cc`: the
/// newest one not newer than the device (PTX is forward compatible).
///
/// # Errors
/// Devices older than compute capability 8.0 (the kernels use bf16 and
/// `mma.sync` m16n8k16, Ampere's).
pub fn arch_for(cc: (i32, i32)) -> Result<(usize, &'static str)> {
    if cc >= (9, 0) {
        Ok((1, ARCHS[1]))
    } else if cc >= (8, 0) {
        Ok((0, ARCHS[0]))
    } else {
        Err(CudaError::Unsupported(format!(
            "compute capability {}.{} is older than 8.0 (Ampere), the oldest the kernels support",
            cc.0, cc.1
        )))
    }
}

/// Hex SHA-256 of a file's text.
pub fn digest(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The sources whose text differs from what the embedded PTX was made from
/// (or that `SOURCES` does not list): empty when the PTX is current.
pub fn stale() -> Vec<String> {
    let listed = |name: &str| {
        SOURCES
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once(' '))
            .find(|(n, _)| *n == name)
            .map(|(_, d)| d.trim().to_string())
    };
    let files = HEADERS
        .iter()
        .map(|(n, t)| (*n, *t))
        .chain(KERNELS.iter().map(|k| (k.file, k.source)));
    files
        .filter(|(name, text)| listed(name).as_deref() != Some(digest(text).as_str()))
        .map(|(name, _)| name.to_string())
        .collect()
}

/// The embedded PTX of `k` for the device's architecture.
pub fn ptx(k: &KernelSource, cc: (i32, i32)) -> Result<&'static str> {
    let (i, _) = arch_for(cc)?;
    Ok(k.ptx[i])
}

/// Where kernels come from (`ENVELOPE_KERNELS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    /// NVRTC when it loads with its headers, else embedded.
    Auto,
    Nvrtc,
    Embedded,
}

/// Where GEMMs run (`ENVELOPE_GEMM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmChoice {
    /// cuBLAS when it loads, else the kernels.
    Auto,
    Cublas,
    Kernels,
}

fn env_choice<T>(
    var: &str,
    allowed: &'static str,
    parse: impl Fn(&str) -> Option<T>,
    default: T,
) -> Result<T> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(v) if v.trim().is_empty() => Ok(default),
        Ok(v) => parse(v.trim().to_ascii_lowercase().as_str()).ok_or_else(|| CudaError::Setting {
            name: var.to_string(),
            value: v.clone(),
            allowed,
        }),
    }
}

impl KernelChoice {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "nvrtc" => Some(Self::Nvrtc),
            "embedded" => Some(Self::Embedded),
            _ => None,
        }
    }

    /// From `ENVELOPE_KERNELS` (unset: auto).
    ///
    /// # Errors
    /// [`CudaError::Setting`] for any other value.
    pub fn from_env() -> Result<Self> {
        env_choice(
            "ENVELOPE_KERNELS",
            "auto, nvrtc, embedded",
            Self::parse,
            Self::Auto,
        )
    }
}

impl GemmChoice {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "cublas" => Some(Self::Cublas),
            "kernels" => Some(Self::Kernels),
            _ => None,
        }
    }

    /// From `ENVELOPE_GEMM` (unset: auto).
    ///
    /// # Errors
    /// [`CudaError::Setting`] for any other value.
    pub fn from_env() -> Result<Self> {
        env_choice(
            "ENVELOPE_GEMM",
            "auto, cublas, kernels",
            Self::parse,
            Self::Auto,
        )
    }
}

/// Decides between a toolkit part that may be missing and the built-in
/// one: `forced` by the setting, or under `auto` the toolkit's when `try_it`
/// succeeds. Returns the toolkit part (or `None` for the built-in one) and,
/// when auto fell back, why.
pub fn decide<T>(
    setting_is_auto: bool,
    use_toolkit: bool,
    try_it: impl FnOnce() -> Result<T>,
) -> Result<(Option<T>, Option<String>)> {
    if !use_toolkit {
        return Ok((None, None));
    }
    match try_it() {
        Ok(t) => Ok((Some(t), None)),
        Err(e) if setting_is_auto => Ok((None, Some(e.to_string()))),
        Err(e) => Err(e),
    }
}

/// Where one device's kernels come from: NVRTC (with its disk cache) or the
/// embedded PTX.
pub enum PtxSource {
    Nvrtc(Compiler),
    Embedded { arch: &'static str },
}

impl PtxSource {
    /// Decides per `ENVELOPE_KERNELS` for a device of compute capability
    /// `cc` whose driver supports CUDA `driver_cuda` (`13.0`). Under `auto`
    /// the embedded PTX is taken when NVRTC or the headers are missing, or
    /// when the machine's NVRTC is newer than its driver; the second value
    /// says why.
    ///
    /// # Errors
    /// A forced source that is not usable, a driver too old for the embedded
    /// PTX, a device older than compute capability 8.0.
    pub fn choose(cc: (i32, i32), driver_cuda: &str) -> Result<(PtxSource, Option<String>)> {
        let choice = KernelChoice::from_env()?;
        let (compiler, why) = decide(
            choice == KernelChoice::Auto,
            choice != KernelChoice::Embedded,
            || {
                let c = Compiler::new()?;
                match version_warning(c.nvrtc_version(), driver_cuda) {
                    Some(w) => Err(CudaError::Unsupported(w)),
                    None => Ok(c),
                }
            },
        )?;
        if let Some(c) = compiler {
            return Ok((PtxSource::Nvrtc(c), None));
        }
        let source = Self::embedded_for(cc, driver_cuda).map_err(|e| match &why {
            Some(w) => CudaError::Unsupported(format!("{e}, and NVRTC is not usable ({w})")),
            None => e,
        })?;
        let why = why.map(|w| {
            format!(
                "{w}; using the PTX embedded in the binary ({})",
                source.describe()
            )
        });
        Ok((source, why))
    }

    /// The embedded PTX for a device of compute capability `cc` whose driver
    /// supports CUDA `driver_cuda`.
    ///
    /// # Errors
    /// A driver older than the embedded PTX's CUDA, a device older than 8.0.
    pub fn embedded_for(cc: (i32, i32), driver_cuda: &str) -> Result<PtxSource> {
        if too_old(NVRTC, driver_cuda) {
            let (ma, mi) = NVRTC;
            return Err(CudaError::Unsupported(format!(
                "the embedded kernels were compiled by NVRTC {ma}.{mi} and need a driver for CUDA {ma}.{mi} or newer (R580+); this driver supports CUDA {driver_cuda}"
            )));
        }
        let (_, arch) = arch_for(cc)?;
        Ok(PtxSource::Embedded { arch })
    }

    /// The PTX of `k` for a device of compute capability `cc` (`arch` is its
    /// `compute_XY`, what NVRTC compiles for).
    ///
    /// # Errors
    /// A kernel NVRTC does not compile.
    pub fn ptx(&self, k: &KernelSource, cc: (i32, i32), arch: &str) -> Result<Compiled> {
        match self {
            PtxSource::Nvrtc(c) => c.compile(k, arch),
            PtxSource::Embedded { .. } => Ok(Compiled {
                ptx: ptx(k, cc)?.to_string(),
                from_cache: false,
                key: digest(k.source),
            }),
        }
    }

    /// `nvrtc 13.0 (<path>)` or `embedded compute_90 (NVRTC 13.0)`.
    pub fn describe(&self) -> String {
        match self {
            PtxSource::Nvrtc(c) => {
                let (ma, mi) = c.nvrtc_version();
                format!("nvrtc {ma}.{mi} ({})", c.nvrtc.path)
            }
            PtxSource::Embedded { arch } => {
                format!("embedded {arch} (NVRTC {}.{})", NVRTC.0, NVRTC.1)
            }
        }
    }

    /// NVRTC's `major.minor` that made the PTX.
    pub fn nvrtc_version(&self) -> (i32, i32) {
        match self {
            PtxSource::Nvrtc(c) => c.nvrtc_version(),
            PtxSource::Embedded { .. } => NVRTC,
        }
    }
}

/// Whether PTX from NVRTC `nvrtc` is too new for a driver supporting CUDA
/// `driver_cuda` (`13.0`).
fn too_old(nvrtc: (i32, i32), driver_cuda: &str) -> bool {
    let mut it = driver_cuda
        .split('.')
        .map(|p| p.parse::<i32>().unwrap_or(0));
    let driver = (it.next().unwrap_or(0), it.next().unwrap_or(0));
    nvrtc > driver
}

/// PTX from an NVRTC newer than the driver does not load
/// (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): say so before the module loads fail.
pub fn version_warning(nvrtc: (i32, i32), driver_cuda: &str) -> Option<String> {
    too_old(nvrtc, driver_cuda).then(|| {
        format!(
            "NVRTC {}.{} is newer than the driver's CUDA {driver_cuda}: its PTX may not load; put an NVRTC <= {driver_cuda} first (ENVELOPE_NVRTC_LIB)",
            nvrtc.0, nvrtc.1
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_ptx_was_made_from_these_sources() {
        let s = stale();
        assert!(
            s.is_empty(),
            "kernels/ptx/ is stale for {s:?}: run scripts/gen-ptx.sh"
        );
    }

    #[test]
    fn a_changed_source_is_stale() {
        assert_ne!(digest("a"), digest("b"));
        let k = &KERNELS[0];
        let line = SOURCES
            .lines()
            .find(|l| l.starts_with(&format!("{} ", k.file)))
            .unwrap();
        assert!(line.ends_with(&digest(k.source)));
        assert_ne!(digest(&format!("{} ", k.source)), digest(k.source));
    }

    #[test]
    fn every_entry_is_in_the_embedded_ptx_of_every_arch() {
        for k in KERNELS {
            for (i, arch) in ARCHS.iter().enumerate() {
                assert!(
                    k.ptx[i].contains(&format!(".target sm_{}", &arch["compute_".len()..])),
                    "{} {arch}",
                    k.file
                );
                for e in k.entries {
                    assert!(
                        k.ptx[i].contains(&format!(".entry {e}(")),
                        "{} ({arch}): no {e}",
                        k.file
                    );
                }
            }
        }
    }

    #[test]
    fn devices_take_the_newest_arch_they_can_run() {
        assert_eq!(arch_for((9, 0)).unwrap().1, "compute_90");
        assert_eq!(arch_for((10, 0)).unwrap().1, "compute_90");
        assert_eq!(arch_for((12, 0)).unwrap().1, "compute_90");
        assert_eq!(arch_for((8, 9)).unwrap().1, "compute_80");
        assert_eq!(arch_for((8, 0)).unwrap().1, "compute_80");
        let e = arch_for((7, 5)).unwrap_err().to_string();
        assert!(e.contains("7.5") && e.contains("8.0"), "{e}");
    }

    #[test]
    fn settings_parse_and_auto_falls_back_with_the_reason() {
        assert_eq!(
            KernelChoice::parse("embedded"),
            Some(KernelChoice::Embedded)
        );
        assert_eq!(KernelChoice::parse("cuda"), None);
        assert_eq!(GemmChoice::parse("kernels"), Some(GemmChoice::Kernels));
        assert_eq!(GemmChoice::parse("cublaslt"), None);
        let missing = || -> Result<u32> {
            Err(CudaError::LibraryMissing {
                library: "libnvrtc.so",
                tried: "libnvrtc.so.13".into(),
                hint: "install it",
            })
        };
        // auto: the built-in part, and why.
        let (got, why) = decide(true, true, missing).unwrap();
        assert!(got.is_none() && why.unwrap().contains("libnvrtc.so"));
        // forced toolkit: the error.
        assert!(decide(false, true, missing).is_err());
        // forced built-in: the toolkit is not even tried.
        let (got, why) = decide(false, false, || -> Result<u32> { panic!("tried") }).unwrap();
        assert!(got.is_none() && why.is_none());
        assert_eq!(decide(true, true, || Ok(7)).unwrap(), (Some(7), None));
    }
}
