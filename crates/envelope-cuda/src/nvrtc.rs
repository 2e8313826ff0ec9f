//! A thin NVRTC binding of our own (seven functions through `libloading`).
//! cudarc's NVRTC loader only looks for the sonames of its version feature
//! and cannot be pointed at a file; the compile check and the self-test need
//! an explicit library (`ENVELOPE_NVRTC_LIB`, a pip wheel) and a failure that
//! is a value. NVRTC needs no GPU and no driver.

use crate::error::{CudaError, Result};
use crate::libs::{open_path, probe, CudaLib};
use libloading::{Library, Symbol};
use std::ffi::{c_char, c_int, c_void, CStr, CString};

type Prog = *mut c_void;

/// A loaded NVRTC library.
pub struct Nvrtc {
    lib: Library,
    /// The file or soname that was opened.
    pub path: String,
}

impl Nvrtc {
    /// `ENVELOPE_NVRTC_LIB` if set (and only it), else the usual places.
    ///
    /// # Errors
    /// [`CudaError::LibraryMissing`] naming `libnvrtc.so`, or
    /// [`CudaError::Nvrtc`] when the file opens but is not NVRTC.
    pub fn load() -> Result<Nvrtc> {
        let path = probe(CudaLib::Nvrtc)?;
        Self::load_from(&path)
    }

    pub fn load_from(path: &str) -> Result<Nvrtc> {
        preload_builtins(path);
        let lib = open_path(path).map_err(|e| CudaError::LibraryMissing {
            library: "libnvrtc.so",
            tried: format!("{path} ({e})"),
            hint: "install the nvidia-cuda-nvrtc wheel or the CUDA toolkit",
        })?;
        let n = Nvrtc {
            lib,
            path: path.to_string(),
        };
        n.version()?; // every symbol is resolved at first use; check one now
        Ok(n)
    }

    /// Resolves a symbol of the NVRTC C API.
    fn sym<T>(&self, name: &'static str) -> Result<Symbol<'_, T>> {
        // SAFETY: the signatures below are NVRTC's documented C API.
        unsafe { self.lib.get::<T>(name.as_bytes()) }.map_err(|e| CudaError::Nvrtc {
            call: name,
            message: format!("symbol missing from {}: {e}", self.path),
        })
    }

    fn check(&self, call: &'static str, r: c_int) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        let msg = self
            .sym::<unsafe extern "C" fn(c_int) -> *const c_char>("nvrtcGetErrorString")
            .ok()
            .map(|f| {
                unsafe { CStr::from_ptr(f(r)) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_default();
        Err(CudaError::Nvrtc {
            call,
            message: format!("code {r} {msg}"),
        })
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> Result<(i32, i32)> {
        let f =
            self.sym::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>("nvrtcVersion")?;
        let (mut ma, mut mi) = (0, 0);
        self.check("nvrtcVersion", unsafe { f(&mut ma, &mut mi) })?;
        Ok((ma, mi))
    }

    /// Compiles `source` (named `name`) with in-memory `headers` (name,
    /// text) and `options`, returning the PTX.
    ///
    /// # Errors
    /// [`CudaError::Compile`] with NVRTC's log when the source does not
    /// compile; [`CudaError::Nvrtc`] for any other failure.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[String],
        arch: &str,
    ) -> Result<String> {
        type Create = unsafe extern "C" fn(
            *mut Prog,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> c_int;
        type Compile = unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int;
        type Destroy = unsafe extern "C" fn(*mut Prog) -> c_int;
        let c = |s: &str| CString::new(s).expect("no NUL in kernel text");
        let src = c(source);
        let cname = c(name);
        let hsrc: Vec<CString> = headers.iter().map(|h| c(h.1)).collect();
        let hname: Vec<CString> = headers.iter().map(|h| c(h.0)).collect();
        let hsrc_p: Vec<*const c_char> = hsrc.iter().map(|s| s.as_ptr()).collect();
        let hname_p: Vec<*const c_char> = hname.iter().map(|s| s.as_ptr()).collect();
        let opts: Vec<CString> = options.iter().map(|o| c(o)).collect();
        let opts_p: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();

        let mut prog: Prog = std::ptr::null_mut();
        let create = self.sym::<Create>("nvrtcCreateProgram")?;
        self.check("nvrtcCreateProgram", unsafe {
            create(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                headers.len() as c_int,
                hsrc_p.as_ptr(),
                hname_p.as_ptr(),
            )
        })?;
        let result = (|| {
            let compile = self.sym::<Compile>("nvrtcCompileProgram")?;
            let rc = unsafe { compile(prog, opts_p.len() as c_int, opts_p.as_ptr()) };
            if rc != 0 {
                let log = self.text(prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")?;
                return Err(CudaError::Compile {
                    kernel: name.to_string(),
                    arch: arch.to_string(),
                    log,
                });
            }
            self.text(prog, "nvrtcGetPTXSize", "nvrtcGetPTX")
        })();
        if let Ok(destroy) = self.sym::<Destroy>("nvrtcDestroyProgram") {
            unsafe { destroy(&mut prog) };
        }
        result
    }

    /// Reads one of the program's NUL-terminated outputs (log or PTX).
    fn text(&self, prog: Prog, size_fn: &'static str, get_fn: &'static str) -> Result<String> {
        let size = self.sym::<unsafe extern "C" fn(Prog, *mut usize) -> c_int>(size_fn)?;
        let get = self.sym::<unsafe extern "C" fn(Prog, *mut c_char) -> c_int>(get_fn)?;
        let mut n = 0usize;
        self.check(size_fn, unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n.max(1)];
        self.check(get_fn, unsafe {
            get(prog, buf.as_mut_ptr() as *mut c_char)
        })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }
}

/// NVRTC `dlopen`s `libnvrtc-builtins.so.<major>.<minor>` by name at its
/// first compile, and the pip wheel's libnvrtc has no RUNPATH, so the
/// builtins next to it are not found unless that directory is on
/// `LD_LIBRARY_PATH`. Opening them here first (kept loaded) lets the
/// loader match the soname.
fn preload_builtins(nvrtc_path: &str) {
    let dir = std::path::Path::new(nvrtc_path)
        .parent()
        .filter(|d| !d.as_os_str().is_empty());
    let Some(Ok(rd)) = dir.map(std::fs::read_dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("libnvrtc-builtins.so") {
            let _ = crate::libs::keep_loaded(&e.path().to_string_lossy());
        }
    }
}
