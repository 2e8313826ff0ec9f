//! The kernels of `kernels/` run on the CPU: each `.cu` file is compiled by
//! the host C++ compiler (`c++`, or `$CXX`) against `kernels/emu/emu.h`, a small
//! emulation of the CUDA subset the kernels use (threads as fibers switched
//! at barriers, shared memory, warp shuffles, f16/bf16/fp8 conversions,
//! `mma.sync.m16n8k16`), into a shared library that is loaded and launched
//! with the same grid, block and arguments as on a GPU. A fake CUDA driver
//! ([`Emulator::driver`]) runs every launch of a process on them, so the
//! GPU self-test (`envelope cuda-selftest --emulate`, `tests/it/kernel_emu.rs`)
//! and the engine's CUDA backend run unchanged through cudarc and
//! [`crate::runtime`], and every kernel's own source is executed and
//! checked against its CPU reference on machines without a GPU, CI
//! included.
//!
//! What it does not show: speed, races between threads of a block (fibers
//! run one at a time), memory-model and alignment faults, and the last ulps
//! of `expf` and friends. A GPU run (`scripts/device-check.sh`) still decides.

use crate::error::{CudaError, Result};
use crate::geometry::Launch;
use crate::kernels::{KernelSource, HEADERS, KERNELS};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// The emulation header and the CUDA headers it stands in for.
use envelope_kernels::EMU_HEADERS;

/// The start of the name the fake driver gives its one device.
pub const DEVICE_NAME: &str = "envelope CPU emulator";

/// Numbers the temporary outputs of concurrent builds (test threads).
static BUILDS: AtomicUsize = AtomicUsize::new(0);

/// The fake CUDA driver (`libcuda.so.1`) that runs launches on the
/// emulated kernels: see [`Emulator::driver`].
const FAKE_DRIVER: &str = envelope_kernels::EMU_DRIVER;

/// Compiler flags: no FMA contraction (the CPU references round each
/// operation), type punning as the kernels do it (`*(const u32*)p`).
const FLAGS: &[&str] = &[
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-w",
    // The fibers switch stacks with _longjmp, which the fortified
    // longjmp would refuse.
    "-U_FORTIFY_SOURCE",
];

/// A host buffer standing in for device memory: 16-byte aligned (the
/// kernels' vector loads), freed on drop. Kernels write through its
/// pointer, so it hands out no references to its bytes.
pub struct HostBuf {
    ptr: *mut u128,
    words: usize,
    len: usize,
}

impl HostBuf {
    pub fn zeroed(len: usize) -> HostBuf {
        let words = len.div_ceil(16).max(1);
        let b: Box<[u128]> = vec![0u128; words].into_boxed_slice();
        HostBuf {
            ptr: Box::into_raw(b) as *mut u128,
            words,
            len,
        }
    }

    pub fn from_bytes(b: &[u8]) -> HostBuf {
        let h = HostBuf::zeroed(b.len());
        // SAFETY: the allocation holds at least `b.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), h.ptr as *mut u8, b.len()) };
        h
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of the bytes (after the kernels that wrote them returned).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // SAFETY: the allocation holds `len` bytes; no launch is running
        // (launches are synchronous).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr as *const u8, v.as_mut_ptr(), self.len) };
        v
    }

    /// The "device pointer" a kernel argument carries.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `Box::into_raw` of a `[u128]` of `words`.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr, self.words,
            )))
        };
    }
}

/// One kernel argument, as `cuLaunchKernel` takes them: a pointer to each
/// value. Buffers pass their address ([`HostBuf::addr`]).
#[derive(Debug, Clone, Copy)]
pub enum EmuArg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

/// One compiled kernel file.
#[derive(Debug, Clone)]
pub struct Built {
    pub file: &'static str,
    pub seconds: f64,
    pub from_cache: bool,
    pub error: Option<String>,
}

type LaunchFn = unsafe extern "C" fn(
    *const u32,
    *const u32,
    unsafe extern "C" fn(*mut *mut c_void),
    *mut *mut c_void,
    *mut c_char,
    c_int,
) -> c_int;

/// The kernels of `kernels/`, compiled for and loaded on the CPU.
pub struct Emulator {
    libs: HashMap<&'static str, libloading::Library>,
    /// `c++ --version`'s first line.
    pub compiler: String,
    pub dir: PathBuf,
    pub built: Vec<Built>,
}

fn err(m: impl Into<String>) -> CudaError {
    CudaError::Emulator(m.into())
}

/// The translation unit of one kernel file: the emulation, the file, and an
/// `emu_call_<entry>` per entry point that unpacks the argument pointers.
fn unit(k: &KernelSource) -> String {
    let mut s = format!("#include \"emu.h\"\n#include \"{}\"\n", k.file);
    for e in k.entries {
        s.push_str(&format!("EMU_KERNEL({e})\n"));
    }
    s
}

impl Emulator {
    /// Compiles every kernel file (in parallel, up to the CPU count) into
    /// `dir` (default: a folder under the temp dir named by the digest of
    /// the compiler, the emulation and the sources, so unchanged kernels
    /// are not rebuilt) and loads them. A file that fails to compile is
    /// recorded in [`Emulator::built`]; its kernels then fail to launch.
    ///
    /// # Errors
    /// No C++ compiler, or a folder that cannot be written.
    pub fn build(dir: Option<&Path>) -> Result<Emulator> {
        Self::build_files(KERNELS, dir)
    }

    /// [`Emulator::build`] for any kernel files (they may include
    /// `common.cuh`); the emulator's own tests run small kernels this way.
    ///
    /// # Errors
    /// As [`Emulator::build`].
    pub fn build_files(files: &'static [KernelSource], dir: Option<&Path>) -> Result<Emulator> {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let version = Command::new(&cxx).arg("--version").output().map_err(|e| {
            err(format!(
                "no C++ compiler: `{cxx} --version` failed ({e}); install g++ or set CXX"
            ))
        })?;
        let compiler = String::from_utf8_lossy(&version.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();
        let mut h = Sha256::new();
        h.update(compiler.as_bytes());
        for f in FLAGS {
            h.update(f.as_bytes());
        }
        for (n, t) in EMU_HEADERS.iter().chain(HEADERS) {
            h.update(n.as_bytes());
            h.update(t.as_bytes());
        }
        h.update(FAKE_DRIVER.as_bytes());
        for k in files {
            h.update(unit(k).as_bytes());
            h.update(k.source.as_bytes());
        }
        let digest: String = h.finalize()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let dir = dir
            .map(Path::to_path_buf)
            .unwrap_or_else(|| std::env::temp_dir().join(format!("envelope-emu-{digest}")));
        let io = |p: &Path, e: std::io::Error| err(format!("{}: {e}", p.display()));
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        for (n, t) in EMU_HEADERS.iter().chain(HEADERS) {
            let p = dir.join(n);
            std::fs::write(&p, t).map_err(|e| io(&p, e))?;
        }
        for k in files {
            let p = dir.join(k.file);
            std::fs::write(&p, k.source).map_err(|e| io(&p, e))?;
            let p = dir.join(format!("{}.emu.cpp", k.file));
            std::fs::write(&p, unit(k)).map_err(|e| io(&p, e))?;
        }
        let lib = |k: &KernelSource| dir.join(format!("{}.emu.so", k.file));
        let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
        let mut built = Vec::new();
        for chunk in files.chunks(jobs) {
            let mut running = Vec::new();
            for k in chunk {
                let t = Instant::now();
                if lib(k).is_file() {
                    built.push(Built {
                        file: k.file,
                        seconds: 0.0,
                        from_cache: true,
                        error: None,
                    });
                    continue;
                }
                // Built under a temporary name and renamed, so a concurrent
                // build (another test process) never loads half a library.
                let tmp = dir.join(format!(
                    "{}.emu.so.{}-{}",
                    k.file,
                    std::process::id(),
                    BUILDS.fetch_add(1, Ordering::Relaxed)
                ));
                let child = Command::new(&cxx)
                    .args(FLAGS)
                    .arg("-I")
                    .arg(&dir)
                    .arg("-o")
                    .arg(&tmp)
                    .arg(dir.join(format!("{}.emu.cpp", k.file)))
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .map_err(|e| err(format!("running {cxx}: {e}")))?;
                running.push((k, t, tmp, child));
            }
            for (k, t, tmp, child) in running {
                let out = child
                    .wait_with_output()
                    .map_err(|e| err(format!("running {cxx}: {e}")))?;
                let error = if out.status.success() {
                    std::fs::rename(&tmp, lib(k))
                        .err()
                        .map(|e| format!("{}: {e}", lib(k).display()))
                } else {
                    let log = String::from_utf8_lossy(&out.stderr);
                    Some(format!(
                        "{cxx} failed on {}:\n{}",
                        k.file,
                        log.lines().take(30).collect::<Vec<_>>().join("\n")
                    ))
                };
                built.push(Built {
                    file: k.file,
                    seconds: t.elapsed().as_secs_f64(),
                    from_cache: false,
                    error,
                });
            }
        }
        let mut libs = HashMap::new();
        for b in &mut built {
            if b.error.is_some() {
                continue;
            }
            let k = files
                .iter()
                .find(|k| k.file == b.file)
                .expect("built from KERNELS");
            // SAFETY: our own library, built just now from emu.h and the
            // kernel source; its initialisers only set up statics.
            match unsafe { libloading::Library::new(lib(k)) } {
                Ok(l) => {
                    libs.insert(k.file, l);
                }
                Err(e) => b.error = Some(format!("loading {}: {e}", lib(k).display())),
            }
        }
        Ok(Emulator {
            libs,
            compiler,
            dir,
            built,
        })
    }

    /// Builds (once per emulator folder) a CUDA driver library,
    /// `DIR/driver/libcuda.so.1` (and `libcuda.so`), that runs every launch
    /// on these emulated kernels: a process started with [`Emulator::env`]
    /// sees one CUDA device, and the engine's CUDA backend (cudarc, the
    /// runtime, the forward, CUDA graphs) runs on the CPU unchanged. Returns
    /// the folder to put on `LD_LIBRARY_PATH`.
    ///
    /// # Errors
    /// The compiler fails, or the folder cannot be written.
    pub fn driver(&self) -> Result<PathBuf> {
        let dir = self.dir.join("driver");
        let lib = dir.join("libcuda.so.1");
        if lib.is_file() {
            return Ok(dir);
        }
        let io = |p: &Path, e: std::io::Error| err(format!("{}: {e}", p.display()));
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        let src = dir.join("fake_cuda.cpp");
        std::fs::write(&src, FAKE_DRIVER).map_err(|e| io(&src, e))?;
        let tmp = dir.join(format!(
            "libcuda.so.1.{}-{}",
            std::process::id(),
            BUILDS.fetch_add(1, Ordering::Relaxed)
        ));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-o"])
            .arg(&tmp)
            .arg(&src)
            .arg("-ldl")
            .output()
            .map_err(|e| err(format!("running {cxx}: {e}")))?;
        if !out.status.success() {
            return Err(err(format!(
                "{cxx} failed on fake_cuda.cpp:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        std::fs::rename(&tmp, &lib).map_err(|e| io(&lib, e))?;
        let link = dir.join("libcuda.so");
        match std::os::unix::fs::symlink("libcuda.so.1", &link) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(io(&link, e)),
            _ => {}
        }
        Ok(dir)
    }

    /// The environment of a process that runs on the emulated GPU: the fake
    /// driver first on `LD_LIBRARY_PATH`, `ENVELOPE_EMU_DIR`, and the
    /// kernel and GEMM sources the emulator has (`ENVELOPE_KERNELS=embedded`:
    /// the PTX is not run, only named; `ENVELOPE_GEMM=kernels`: no cuBLAS).
    ///
    /// # Errors
    /// As [`Emulator::driver`].
    pub fn env(&self) -> Result<Vec<(String, String)>> {
        let driver = self.driver()?;
        let mut path = driver.display().to_string();
        if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
            if !old.is_empty() {
                path = format!("{path}:{old}");
            }
        }
        Ok(vec![
            ("LD_LIBRARY_PATH".into(), path),
            ("ENVELOPE_EMU_DIR".into(), self.dir.display().to_string()),
            ("ENVELOPE_KERNELS".into(), "embedded".into()),
            ("ENVELOPE_GEMM".into(), "kernels".into()),
        ])
    }

    /// Runs kernel `entry` of `file` over the launch's grid and block, to
    /// completion (synchronous, one launch at a time per file).
    ///
    /// # Errors
    /// The file did not build, the entry is not in it, a bad launch shape,
    /// or threads that wait at different barriers (a deadlock on a GPU).
    pub fn launch(&self, file: &str, entry: &str, l: Launch, args: &[EmuArg]) -> Result<()> {
        let lib = self
            .libs
            .get(file)
            .ok_or_else(|| err(format!("{file} did not build")))?;
        let (launch, call) = unsafe {
            // SAFETY: the symbols' types are those emu.h defines.
            let launch = lib
                .get::<LaunchFn>(b"emu_launch\0")
                .map_err(|e| err(format!("{file}: emu_launch: {e}")))?;
            let call = lib
                .get::<unsafe extern "C" fn(*mut *mut c_void)>(
                    format!("emu_call_{entry}\0").as_bytes(),
                )
                .map_err(|e| err(format!("{file}: no kernel {entry}: {e}")))?;
            (*launch, *call)
        };
        if l.shared_bytes > 0 {
            return Err(err(format!(
                "{entry}: dynamic shared memory ({} bytes) is not emulated",
                l.shared_bytes
            )));
        }
        // One 8-byte slot per argument; 4-byte values sit in the low bytes
        // (little-endian), where `*(int*)slot` reads them.
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                EmuArg::Ptr(p) | EmuArg::U64(p) => p,
                EmuArg::I32(v) => v as u32 as u64,
                EmuArg::I64(v) => v as u64,
                EmuArg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let grid = [l.grid.0, l.grid.1, l.grid.2];
        let block = [l.block.0, l.block.1, l.block.2];
        let mut msg = [0 as c_char; 512];
        // SAFETY: the argument list matches the kernel's signature (the same
        // list the GPU launch passes), every buffer outlives the call, and
        // the call returns only when the launch has finished.
        let rc = unsafe {
            launch(
                grid.as_ptr(),
                block.as_ptr(),
                call,
                ptrs.as_mut_ptr(),
                msg.as_mut_ptr(),
                msg.len() as c_int,
            )
        };
        if rc != 0 {
            // SAFETY: emu_launch wrote a NUL-terminated message.
            let m = unsafe { std::ffi::CStr::from_ptr(msg.as_ptr()) };
            return Err(err(format!("{entry}: {}", m.to_string_lossy())));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The self-test knows the fake driver's device by this name.
    #[test]
    fn the_fake_driver_names_its_device_so() {
        assert!(FAKE_DRIVER.contains(&format!("\"{DEVICE_NAME} (no GPU)\"")));
    }
}
