//! Run-time compilation: NVRTC for the device's architecture, with an
//! on-disk PTX cache keyed by SHA-256 of (source, headers, options, arch,
//! NVRTC version), and the search for the CUDA include directory that holds
//! `cuda_bf16.h`/`cuda_fp16.h`.

use crate::error::{CudaError, Result};
use crate::kernels::{KernelSource, HEADERS};
use crate::nvrtc::Nvrtc;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The cache directory: `ENVELOPE_KERNEL_CACHE`, else
/// `~/.cache/envelope/kernels`; `None` when neither can be named.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("ENVELOPE_KERNEL_CACHE") {
        return Some(d.into());
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/envelope/kernels"))
}

/// Candidate include directories, in order: `ENVELOPE_CUDA_INCLUDE`,
/// `CUDA_HOME/include`, `/usr/local/cuda/include`, the `nvidia-cuda-runtime`
/// wheel's `nvidia/cu13/include` (CUDA 13 wheels ship every header there).
pub fn include_candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(d) = std::env::var_os("ENVELOPE_CUDA_INCLUDE") {
        c.push(PathBuf::from(d));
        return c; // explicit: no fallback that could hide a wrong setting
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            c.push(PathBuf::from(h).join("include"));
        }
    }
    c.push("/usr/local/cuda/include".into());
    c.extend(crate::libs::wheel_dirs("include"));
    c
}

/// The first candidate holding `cuda_bf16.h`.
///
/// # Errors
/// [`CudaError::NoInclude`] listing what was tried.
pub fn include_dir() -> Result<PathBuf> {
    let c = include_candidates();
    c.iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
        .cloned()
        .ok_or_else(|| CudaError::NoInclude {
            tried: c
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// NVRTC options for `arch` (`compute_80`): C++17, accurate math (the CPU
/// references are compared with tight tolerances), and the include path.
pub fn options(arch: &str, include: &Path) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        format!("--include-path={}", include.display()),
    ]
}

/// Hex SHA-256 over everything that changes the PTX. Fields are length
/// prefixed so no two different inputs hash the same bytes.
pub fn cache_key(
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
    arch: &str,
    nvrtc_version: (i32, i32),
) -> String {
    let mut h = Sha256::new();
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(source.as_bytes());
    for (n, t) in headers {
        field(n.as_bytes());
        field(t.as_bytes());
    }
    for o in options {
        field(o.as_bytes());
    }
    field(arch.as_bytes());
    field(format!("nvrtc {}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A compiled kernel file.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub ptx: String,
    pub from_cache: bool,
    pub key: String,
}

/// NVRTC plus include directory plus cache.
pub struct Compiler {
    pub nvrtc: Nvrtc,
    pub include: PathBuf,
    pub cache: Option<PathBuf>,
    version: (i32, i32),
}

impl Compiler {
    /// NVRTC from [`Nvrtc::load`], the include directory from
    /// [`include_dir`], the cache from [`cache_dir`].
    pub fn new() -> Result<Compiler> {
        Self::with(Nvrtc::load()?, include_dir()?, cache_dir())
    }

    pub fn with(nvrtc: Nvrtc, include: PathBuf, cache: Option<PathBuf>) -> Result<Compiler> {
        let version = nvrtc.version()?;
        Ok(Compiler {
            nvrtc,
            include,
            cache,
            version,
        })
    }

    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.version
    }

    /// PTX of `k` for `arch`, from the cache when present. A cache that
    /// cannot be read or written is not an error (compile again); a kernel
    /// that does not compile is.
    pub fn compile(&self, k: &KernelSource, arch: &str) -> Result<Compiled> {
        let opts = options(arch, &self.include);
        let key = cache_key(k.source, HEADERS, &opts, arch, self.version);
        let path = self.cache.as_ref().map(|d| d.join(format!("{key}.ptx")));
        if let Some(p) = &path {
            if let Ok(ptx) = std::fs::read_to_string(p) {
                return Ok(Compiled {
                    ptx,
                    from_cache: true,
                    key,
                });
            }
        }
        let ptx = self.nvrtc.compile(k.file, k.source, HEADERS, &opts, arch)?;
        if let Some(p) = &path {
            let _ = write_atomic(p, &ptx);
        }
        Ok(Compiled {
            ptx,
            from_cache: false,
            key,
        })
    }
}

fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_every_input() {
        let o = vec!["--std=c++17".to_string()];
        let base = cache_key("src", &[("h", "x")], &o, "compute_90", (13, 0));
        assert_eq!(base.len(), 64);
        assert_eq!(
            base,
            cache_key("src", &[("h", "x")], &o, "compute_90", (13, 0))
        );
        let others = [
            cache_key("src2", &[("h", "x")], &o, "compute_90", (13, 0)),
            cache_key("src", &[("h", "y")], &o, "compute_90", (13, 0)),
            cache_key("src", &[("h", "x")], &[], "compute_90", (13, 0)),
            cache_key("src", &[("h", "x")], &o, "compute_80", (13, 0)),
            cache_key("src", &[("h", "x")], &o, "compute_90", (13, 1)),
            // Length prefixes: moving bytes between fields changes the key.
            cache_key("srch", &[("", "x")], &o, "compute_90", (13, 0)),
        ];
        for k in others {
            assert_ne!(k, base);
        }
    }

    #[test]
    fn options_name_arch_and_include() {
        let o = options("compute_80", Path::new("/inc"));
        assert!(o.contains(&"--gpu-architecture=compute_80".to_string()));
        assert!(o.contains(&"--include-path=/inc".to_string()));
    }
}
