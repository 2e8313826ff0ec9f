//! The GPU runtime the CUDA backend runs on: an opened device with every
//! kernel of `kernels/` loaded (NVRTC or embedded PTX, see
//! [`crate::embedded`]), cuBLAS and cuBLASLt handles on one stream when
//! cuBLAS is installed, untyped device buffers tagged with their element
//! type, and one typed method per kernel (launch geometry from
//! [`crate::geometry`]).
//!
//! GEMMs: `y[m, n] = x[m, k] W[n, k]^T` with both operands row-major, the
//! layout of every weight. cuBLAS is column-major, so the call computes
//! `y^T = W x^T` ([`linear_gemm`]: `transa = T`, `transb = N`, `m' = n`,
//! `n' = m`, leading dimensions `k`, `k`, `n`), which is also cuBLASLt's
//! required "TN" layout for fp8. bf16/f16 run `cublasGemmEx` with f32
//! accumulation (tensor cores); f32 runs with `CUBLAS_COMPUTE_32F` (no TF32,
//! so the f32 path can be compared tightly with the CPU); fp8 e4m3 runs
//! `cublasLtMatmul` with per-tensor scales on compute capability 8.9+.
//! Without cuBLAS (a machine with only the driver, or `ENVELOPE_GEMM=kernels`)
//! the same products run on `kernels/gemm.cu`: tensor-core `mma.sync` for
//! 16-bit and fp8 operands, f32 FMA for f32, the residual add in the
//! epilogue.

use crate::device::Device;
use crate::embedded::{decide, GemmChoice, KernelChoice, PtxSource};
use crate::error::{guarded, CudaError, Result};
use crate::kernels::KERNELS;
use crate::libs::{probe, CudaLib};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod buf;
mod gemm;
mod graph;
mod ops;
pub use buf::{decode, encode, le_bytes, Arg, Buf, DType, F32Slice, Fp8Buf};
pub use gemm::{blas_gemm_reference, gemm_kernel_entry, linear_gemm, GemmDesc};
use gemm::{Lt, LT_WORKSPACE};
pub use graph::Graph;
pub use ops::AttnDims;

fn shape(kernel: &'static str, reason: String) -> CudaError {
    CudaError::Shape { kernel, reason }
}

fn drv(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

fn blas_err(call: &'static str) -> impl Fn(cudarc::cublas::result::CublasError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

fn lt_err(call: &'static str) -> impl Fn(cudarc::cublaslt::result::CublasError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

/// Freed stream-ordered memory stays in the device's pool instead of going
/// back to the driver at every synchronisation (the pool's default release
/// threshold is 0): each step allocates and frees its activations. Best
/// effort: a driver without memory pools keeps its default.
fn keep_freed_memory_in_the_pool(device: &Device) {
    use cudarc::driver::sys;
    let _ = device.ctx.bind_to_thread();
    // cudarc panics when a driver lacks a symbol: guarded, and ignored.
    let _ = guarded("cuMemPoolSetAttribute", || {
        // SAFETY: the pool handle comes from the driver for this device; the
        // attribute value is a u64 as documented.
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, device.ctx.cu_device())
                == sys::CUresult::CUDA_SUCCESS
            {
                let mut threshold = u64::MAX;
                let _ = sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut c_void,
                );
            }
        }
    });
}

/// One kernel file of `kernels/`: its PTX (compiled by NVRTC, read from
/// the disk cache, or embedded) and its module load.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelFile {
    pub file: String,
    pub seconds: f64,
    pub ptx_bytes: usize,
    pub from_cache: bool,
    /// Why the file did not compile or load (its entries are missing).
    pub error: Option<String>,
}

/// How [`Gpu::open_device`] comes up. The default is the engine's: every
/// kernel loads, or the open fails.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// A kernel file that does not compile or load is recorded in
    /// [`RuntimeInfo::kernel_files`] and left out (a launch of one of its
    /// entries then fails, "no kernel entry ..."), instead of failing the
    /// open; and NVRTC's failures do not switch to the embedded PTX, so each
    /// file's own result shows. The GPU self-test opens this way.
    pub keep_going: bool,
    /// Where GEMMs run, instead of `ENVELOPE_GEMM`.
    pub gemm: Option<GemmChoice>,
}

/// Facts about how the runtime came up.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RuntimeInfo {
    pub arch: String,
    /// Where the kernels came from: `nvrtc 13.0 (<path>)` or
    /// `embedded compute_90 (NVRTC 13.0)` ([`crate::embedded`]).
    pub kernels: String,
    pub nvrtc_version: String,
    /// NVRTC's include directory (the CUDA headers), when NVRTC compiled.
    pub include_dir: Option<String>,
    /// Kernel files loaded.
    pub kernels_compiled: usize,
    pub kernels_from_cache: usize,
    pub compile_seconds: f64,
    /// Each kernel file's compile and load, in `KERNELS` order.
    pub kernel_files: Vec<KernelFile>,
    /// `cublas` or `kernels` (`kernels/gemm.cu`).
    pub gemm: &'static str,
    /// Why `auto` took a built-in part instead of the toolkit's.
    pub fallbacks: Vec<String>,
    pub fp8: bool,
}

/// An opened device, ready to run the model's operations.
pub struct Gpu {
    pub device: Device,
    pub stream: Arc<CudaStream>,
    funcs: HashMap<String, CudaFunction>,
    /// `None`: GEMMs run on `kernels/gemm.cu`.
    blas: Option<cudarc::cublas::CudaBlas>,
    lt: Option<Mutex<Lt>>,
    /// cuBLAS's workspace (set with `cublasSetWorkspace`).
    _blas_workspace: Option<CudaSlice<u8>>,
    pub info: RuntimeInfo,
}

/// Compiles (or reads) and loads every kernel file of `source`: the
/// entries that loaded and each file's result. Without `keep_going` the
/// first file that fails is the error.
fn load_kernels(
    device: &Device,
    source: &PtxSource,
    arch: &str,
    keep_going: bool,
) -> Result<(HashMap<String, CudaFunction>, Vec<KernelFile>)> {
    let cc = device.info.compute_capability;
    let mut funcs = HashMap::new();
    let mut files = Vec::new();
    for k in KERNELS {
        let t = Instant::now();
        let (mut ptx_bytes, mut from_cache) = (0, false);
        let loaded = (|| -> Result<Vec<(String, CudaFunction)>> {
            let c = source.ptx(k, cc, arch)?;
            ptx_bytes = c.ptx.len();
            from_cache = c.from_cache;
            let module = guarded("cuModuleLoadData", || {
                device.ctx.load_module(cudarc::nvrtc::Ptx::from_src(c.ptx))
            })?
            .map_err(drv("cuModuleLoadData"))?;
            k.entries
                .iter()
                .map(|e| {
                    let f = module
                        .load_function(e)
                        .map_err(drv("cuModuleGetFunction"))?;
                    Ok((e.to_string(), f))
                })
                .collect()
        })();
        let error = match loaded {
            Ok(entries) => {
                funcs.extend(entries);
                None
            }
            Err(e) if keep_going => Some(e.to_string()),
            Err(e) => return Err(e),
        };
        files.push(KernelFile {
            file: k.file.into(),
            seconds: t.elapsed().as_secs_f64(),
            ptx_bytes,
            from_cache,
            error,
        });
    }
    Ok((funcs, files))
}

impl Gpu {
    /// Opens device `ordinal`, loads every kernel (compiled by NVRTC for its
    /// architecture, from the disk cache, or embedded: see
    /// [`crate::embedded`]) and creates the cuBLAS handles when cuBLAS is
    /// there. Needs nothing but the driver.
    ///
    /// # Errors
    /// A missing driver or GPU, a setting forcing a part that is missing
    /// (`ENVELOPE_KERNELS=nvrtc`, `ENVELOPE_GEMM=cublas`), a kernel that does
    /// not compile or load, as a [`CudaError`].
    pub fn open(ordinal: usize) -> Result<Gpu> {
        Self::open_device(Device::open(ordinal)?, OpenOptions::default())
    }

    /// [`Gpu::open`] on a device already opened, as `opts` says.
    ///
    /// # Errors
    /// As [`Gpu::open`]; with [`OpenOptions::keep_going`], a kernel that
    /// does not compile or load is not one.
    pub fn open_device(mut device: Device, opts: OpenOptions) -> Result<Gpu> {
        let cc = device.info.compute_capability;
        let driver = device.info.driver_cuda_version.clone();
        let (mut source, mut kernel_note) = PtxSource::choose(cc, &driver)?;
        let gemm = match opts.gemm {
            Some(g) => g,
            None => GemmChoice::from_env()?,
        };
        // One stream only: cudarc's per-allocation events buy nothing.
        // SAFETY: every buffer is used on the one stream made below alone.
        unsafe { device.ctx.disable_event_tracking() };
        keep_freed_memory_in_the_pool(&device);
        let arch = device.arch();
        let t = Instant::now();
        let (funcs, files) = match load_kernels(&device, &source, &arch, opts.keep_going) {
            Ok(l) => l,
            // auto: NVRTC loaded but a kernel did not compile or load (an
            // NVRTC too old for the GPU, missing builtins, other headers):
            // the embedded PTX may still run.
            Err(e)
                if matches!(source, PtxSource::Nvrtc(_))
                    && KernelChoice::from_env()? == KernelChoice::Auto =>
            {
                source = PtxSource::embedded_for(cc, &driver).map_err(|e2| {
                    CudaError::Unsupported(format!("{e2} (after NVRTC's kernels failed: {e})"))
                })?;
                kernel_note = Some(format!(
                    "{e}; using the PTX embedded in the binary ({})",
                    source.describe()
                ));
                load_kernels(&device, &source, &arch, false)?
            }
            Err(e) => return Err(e),
        };
        let compile_seconds = t.elapsed().as_secs_f64();
        // A stream of our own: CUDA cannot capture graphs on the legacy
        // default stream. Event tracking is off (above), so cudarc's
        // multi-stream bookkeeping adds nothing; everything runs on it.
        let stream = device.ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        let (blas, gemm_note) = decide(
            gemm == GemmChoice::Auto,
            gemm != GemmChoice::Kernels,
            || {
                probe(CudaLib::CublasLt)?;
                let path = probe(CudaLib::Cublas)?;
                let blas = guarded("cublasCreate", || {
                    cudarc::cublas::CudaBlas::new(stream.clone())
                })?
                .map_err(blas_err("cublasCreate"))?;
                // Our own workspace, so that no cuBLAS call allocates: a
                // decode step captured into a CUDA graph must not.
                let ws = stream
                    .alloc_zeros::<u8>(LT_WORKSPACE)
                    .map_err(drv("cuMemAlloc"))?;
                {
                    let (p, _r) = ws.device_ptr(&stream);
                    // SAFETY: the handle and buffer are live; the buffer is
                    // kept in the Gpu for as long as the handle.
                    unsafe {
                        blas_sys::cublasSetWorkspace_v2(
                            *blas.handle(),
                            p as *mut c_void,
                            LT_WORKSPACE,
                        )
                    }
                    .result()
                    .map_err(blas_err("cublasSetWorkspace"))?;
                }
                Ok(((blas, ws), path))
            },
        )?;
        let (blas, cublas_path) = blas.unzip();
        let (blas, blas_workspace) = blas.unzip();
        let fp8 = crate::fp8::fp8_supported(cc);
        let (lt, lt_note) = if fp8 && blas.is_some() {
            decide(gemm == GemmChoice::Auto, true, || {
                let handle = guarded("cublasLtCreate", cudarc::cublaslt::result::create_handle)?
                    .map_err(lt_err("cublasLtCreate"))?;
                let workspace = stream
                    .alloc_zeros::<u8>(LT_WORKSPACE)
                    .map_err(drv("cuMemAlloc"))?;
                Ok(Mutex::new(Lt {
                    handle,
                    workspace,
                    plans: HashMap::new(),
                }))
            })?
        } else {
            (None, None)
        };
        let include_dir = match &source {
            PtxSource::Nvrtc(c) => {
                device.info.libraries.nvrtc = Some(c.nvrtc.path.clone());
                Some(c.include.display().to_string())
            }
            PtxSource::Embedded { .. } => None,
        };
        device.info.libraries.cublas = cublas_path;
        let (ma, mi) = source.nvrtc_version();
        let fallbacks = [
            kernel_note,
            gemm_note.map(|w| format!("{w}; GEMMs run on kernels/gemm.cu")),
            lt_note.map(|w| format!("{w}; fp8 GEMMs run on kernels/gemm.cu")),
        ];
        Ok(Gpu {
            info: RuntimeInfo {
                arch,
                kernels: source.describe(),
                nvrtc_version: format!("{ma}.{mi}"),
                include_dir,
                kernels_compiled: files.iter().filter(|f| f.error.is_none()).count(),
                kernels_from_cache: files.iter().filter(|f| f.from_cache).count(),
                compile_seconds,
                kernel_files: files,
                gemm: if blas.is_some() { "cublas" } else { "kernels" },
                fallbacks: fallbacks.into_iter().flatten().collect(),
                fp8,
            },
            device,
            stream,
            funcs,
            blas,
            lt,
            _blas_workspace: blas_workspace,
        })
    }

    /// Makes the device's context current on the calling thread (the
    /// engine runs on its own thread).
    pub fn bind(&self) -> Result<()> {
        self.device
            .ctx
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// Returns the memory freed into the device's pool to the driver, so
    /// that [`Gpu::mem_info`] counts it as free (freed buffers stay in the
    /// pool, see `keep_freed_memory_in_the_pool`). Best effort.
    pub fn trim_pool(&self) {
        use cudarc::driver::sys;
        let _ = self.synchronize();
        let _ = guarded("cuMemPoolTrimTo", || {
            // SAFETY: the pool of this device, trimmed after the stream is idle.
            unsafe {
                let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
                if sys::cuDeviceGetDefaultMemPool(&mut pool, self.device.ctx.cu_device())
                    == sys::CUresult::CUDA_SUCCESS
                {
                    let _ = sys::cuMemPoolTrimTo(pool, 0);
                }
                // And what graphs' memory nodes keep.
                let _ = sys::cuDeviceGraphMemTrim(self.device.ctx.cu_device());
            }
        });
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.device.ctx.mem_get_info().map_err(drv("cuMemGetInfo"))
    }

    fn same(kernel: &'static str, a: &Buf, b: &Buf) -> Result<()> {
        if a.dtype != b.dtype {
            return Err(shape(
                kernel,
                format!("dtypes differ: {:?} vs {:?}", a.dtype, b.dtype),
            ));
        }
        Ok(())
    }

    fn need(kernel: &'static str, b: &Buf, len: usize) -> Result<()> {
        if b.len < len {
            return Err(shape(
                kernel,
                format!("buffer holds {} elements, {len} needed", b.len),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU, opening the runtime is an error naming what is missing.
    #[test]
    fn open_without_a_gpu_is_an_error() {
        match std::panic::catch_unwind(|| Gpu::open(0).map(|g| g.info.arch)) {
            Ok(Ok(arch)) => eprintln!("a GPU is present ({arch})"),
            Ok(Err(e)) => eprintln!("{e}"),
            Err(_) => panic!("Gpu::open panicked"),
        }
    }
}
