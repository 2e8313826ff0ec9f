//! Finding the CUDA shared libraries before cudarc touches them. cudarc
//! panics when a library is missing, so each one is opened here first under
//! its candidate names and directories; a miss is a [`CudaError`] naming the
//! library. A hit stays loaded for the life of the process, so cudarc's own
//! `dlopen` by soname (`libcublas.so.13`) finds the already-loaded copy even
//! when it lives outside the loader's search path (a pip wheel, the toolkit's
//! `lib64`).

use crate::error::{CudaError, Result};
use libloading::Library;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The libraries the backend needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLib {
    /// `libcuda.so.1`, installed with the NVIDIA driver.
    Driver,
    /// `libnvrtc.so.13`, the run-time compiler (toolkit or the
    /// `nvidia-cuda-nvrtc` wheel); `ENVELOPE_NVRTC_LIB` names a file.
    Nvrtc,
    /// `libcublasLt.so.13` (toolkit or the `nvidia-cublas` wheel).
    CublasLt,
    /// `libcublas.so.13`.
    Cublas,
}

impl CudaLib {
    pub fn file_name(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so",
            CudaLib::Nvrtc => "libnvrtc.so",
            CudaLib::CublasLt => "libcublasLt.so",
            CudaLib::Cublas => "libcublas.so",
        }
    }

    fn sonames(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so"],
            CudaLib::CublasLt => &["libcublasLt.so.13", "libcublasLt.so"],
            CudaLib::Cublas => &["libcublas.so.13", "libcublas.so"],
        }
    }

    fn env_override(self) -> Option<&'static str> {
        match self {
            CudaLib::Nvrtc => Some("ENVELOPE_NVRTC_LIB"),
            _ => None,
        }
    }

    fn hint(self) -> &'static str {
        match self {
            CudaLib::Driver => "no NVIDIA driver on this machine (libcuda.so.1 comes with the driver)",
            CudaLib::Nvrtc => "install the CUDA 13 toolkit or the nvidia-cuda-nvrtc wheel, or set ENVELOPE_NVRTC_LIB to libnvrtc.so.13",
            CudaLib::CublasLt | CudaLib::Cublas => {
                "install the CUDA 13 toolkit or the nvidia-cublas wheel (or put its lib directory on LD_LIBRARY_PATH)"
            }
        }
    }
}

/// Directories searched after the loader's own path: the toolkit and the
/// pip wheels' `nvidia/cu13/lib` under the usual Python prefixes.
pub fn extra_lib_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            dirs.push(PathBuf::from(h).join("lib64"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/nvidia/lib64".into());
    dirs.extend(wheel_dirs("lib"));
    dirs
}

/// `<python prefix>/lib/python3.*/{site,dist}-packages/nvidia/cu13/<leaf>`
/// for the prefixes where pip puts NVIDIA's wheels.
pub fn wheel_dirs(leaf: &str) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = vec![
        "/usr/local".into(),
        "/usr".into(),
        "/opt/torch/.venv".into(),
    ];
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        prefixes.insert(0, v.into());
    }
    let mut out = Vec::new();
    for p in prefixes {
        let Ok(rd) = std::fs::read_dir(p.join("lib")) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|d| {
                d.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pys.sort();
        for py in pys {
            for pkgs in ["site-packages", "dist-packages"] {
                out.push(py.join(pkgs).join("nvidia/cu13").join(leaf));
            }
        }
    }
    out
}

// Opened libraries are kept here until the process ends (see the module doc).
static KEPT: Mutex<Vec<Library>> = Mutex::new(Vec::new());

/// Opens `lib` (environment override, then sonames through the loader, then
/// the extra directories) and keeps it loaded. Returns what was opened.
///
/// # Errors
/// [`CudaError::LibraryMissing`] naming the library and every name tried.
pub fn probe(lib: CudaLib) -> Result<String> {
    let mut candidates: Vec<String> = Vec::new();
    if let Some(var) = lib.env_override() {
        if let Some(p) = std::env::var_os(var) {
            // An explicit path is the only candidate: a broken one must fail,
            // not silently fall back to another copy.
            let path = Path::new(&p).to_string_lossy().into_owned();
            return open_kept(&path).map(|()| path.clone()).map_err(|e| {
                CudaError::LibraryMissing {
                    library: lib.file_name(),
                    tried: format!("{var}={path} ({e})"),
                    hint: lib.hint(),
                }
            });
        }
    }
    candidates.extend(lib.sonames().iter().map(|s| s.to_string()));
    for d in extra_lib_dirs() {
        for s in lib.sonames() {
            let p = d.join(s);
            if p.exists() {
                candidates.push(p.to_string_lossy().into_owned());
            }
        }
    }
    for c in &candidates {
        if open_kept(c).is_ok() {
            return Ok(c.clone());
        }
    }
    Err(CudaError::LibraryMissing {
        library: lib.file_name(),
        tried: candidates.join(", "),
        hint: lib.hint(),
    })
}

/// Opens a library and keeps it loaded for the life of the process.
pub(crate) fn keep_loaded(name: &str) -> std::result::Result<(), String> {
    open_kept(name)
}

fn open_kept(name: &str) -> std::result::Result<(), String> {
    // SAFETY: loading runs the library's initialisers; NVIDIA's libraries
    // have no unsound ones. Nothing is called through this handle.
    let l = unsafe { Library::new(name) }.map_err(|e| describe(&e))?;
    KEPT.lock().unwrap_or_else(|p| p.into_inner()).push(l);
    Ok(())
}

/// libloading's message with its cause (the loader's own words).
fn describe(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

/// Opens a library from an explicit path for direct use (NVRTC).
pub(crate) fn open_path(path: &str) -> std::result::Result<Library, String> {
    // SAFETY: as in `open_kept`.
    unsafe { Library::new(path) }.map_err(|e| describe(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        // This machine has no driver; where one exists the probe succeeds.
        match probe(CudaLib::Driver) {
            Ok(p) => eprintln!("driver present here: {p}"),
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("libcuda.so"), "{m}");
                assert!(m.contains("libcuda.so.1"), "{m}");
            }
        }
    }
}
