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
use crate::geometry::{self, Launch};
use crate::kernels::KERNELS;
use crate::libs::{probe, CudaLib};
use cudarc::cublas::sys as blas_sys;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, PushKernelArg};
use half::{bf16, f16};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod gemm;
mod graph;
pub use gemm::{blas_gemm_reference, linear_gemm, GemmDesc};
use gemm::{Lt, LT_WORKSPACE};
pub use graph::Graph;

/// Element type of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Bf16,
    /// e4m3fn, with a per-tensor scale held beside it.
    Fp8,
    /// Integer metadata (token ids, positions, block tables).
    U32,
    /// Raw bytes (GGUF blocks before dequantisation).
    U8,
    I32,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::Fp8 | DType::U8 => 1,
            DType::I64 => 8,
        }
    }

    /// The suffix of kernel entry points (`rmsnorm_bf16`).
    pub fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::Fp8 => "fp8",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    fn blas(self) -> Result<blas_sys::cudaDataType> {
        Ok(match self {
            DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            DType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            other => return Err(shape("gemm", format!("no cuBLAS GEMM for {other:?}"))),
        })
    }

    fn lt(self) -> lt_sys::cudaDataType {
        match self {
            DType::F32 => lt_sys::cudaDataType::CUDA_R_32F,
            DType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
            DType::Fp8 => lt_sys::cudaDataType::CUDA_R_8F_E4M3,
            _ => lt_sys::cudaDataType::CUDA_R_16BF,
        }
    }
}

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

/// A typed f32 device slice (RoPE frequencies, fp8 scales).
pub type F32Slice = CudaSlice<f32>;

/// A device buffer of `len` elements of `dtype`.
pub struct Buf {
    pub data: CudaSlice<u8>,
    pub dtype: DType,
    pub len: usize,
}

impl Buf {
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

/// An fp8 matrix or activation: e4m3 bytes and the device f32 scale that
/// multiplies them back.
pub struct Fp8Buf {
    pub data: Buf,
    pub scale: CudaSlice<f32>,
}

/// Host bytes of `x` in `dtype` (f32, f16 or bf16; little-endian).
pub fn encode(dtype: DType, x: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => x
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::Bf16 => x
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// f32 values of host bytes in `dtype`.
pub fn decode(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Bf16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Fp8 => b.iter().map(|&v| crate::fp8::decode(v)).collect(),
        _ => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// Little-endian bytes of plain integers, for metadata uploads.
pub fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    Buf(&'a Buf),
    Raw(&'a CudaSlice<u8>),
    F32s(&'a CudaSlice<f32>),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
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

/// Facts about how the runtime came up.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RuntimeInfo {
    pub arch: String,
    /// Where the kernels came from: `nvrtc 13.0 (<path>)` or
    /// `embedded compute_90 (NVRTC 13.0)` ([`crate::embedded`]).
    pub kernels: String,
    pub nvrtc_version: String,
    pub kernels_compiled: usize,
    pub kernels_from_cache: usize,
    pub compile_seconds: f64,
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
        let mut device = Device::open(ordinal)?;
        let cc = device.info.compute_capability;
        let driver = device.info.driver_cuda_version.clone();
        let (mut source, mut kernel_note) = PtxSource::choose(cc, &driver)?;
        let gemm = GemmChoice::from_env()?;
        // One stream only: cudarc's per-allocation events buy nothing.
        // SAFETY: every buffer is used on the one stream made below alone.
        unsafe { device.ctx.disable_event_tracking() };
        keep_freed_memory_in_the_pool(&device);
        let arch = device.arch();
        let t = Instant::now();
        let load = |source: &PtxSource| -> Result<(HashMap<String, CudaFunction>, usize)> {
            let mut funcs = HashMap::new();
            let mut cached = 0;
            for k in KERNELS {
                let c = source.ptx(k, cc, &arch)?;
                cached += c.from_cache as usize;
                let module = guarded("cuModuleLoadData", || {
                    device.ctx.load_module(cudarc::nvrtc::Ptx::from_src(c.ptx))
                })?
                .map_err(drv("cuModuleLoadData"))?;
                for e in k.entries {
                    let f = module
                        .load_function(e)
                        .map_err(drv("cuModuleGetFunction"))?;
                    funcs.insert(e.to_string(), f);
                }
            }
            Ok((funcs, cached))
        };
        let (funcs, cached) = match load(&source) {
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
                load(&source)?
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
        if let PtxSource::Nvrtc(c) = &source {
            device.info.libraries.nvrtc = Some(c.nvrtc.path.clone());
        }
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
                kernels_compiled: KERNELS.len(),
                kernels_from_cache: cached,
                compile_seconds,
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

    /// A zero-filled buffer.
    pub fn zeros(&self, dtype: DType, len: usize) -> Result<Buf> {
        let data = self
            .stream
            .alloc_zeros::<u8>((len * dtype.size()).max(1))
            .map_err(drv("cuMemAlloc"))?;
        Ok(Buf { data, dtype, len })
    }

    /// An uninitialised buffer, for outputs a kernel writes whole.
    pub fn empty(&self, dtype: DType, len: usize) -> Result<Buf> {
        // SAFETY: u8 has no invalid bit patterns, and every caller passes
        // the buffer to a kernel or GEMM that writes all `len` elements
        // before anything reads them.
        let data = unsafe { self.stream.alloc::<u8>((len * dtype.size()).max(1)) }
            .map_err(drv("cuMemAlloc"))?;
        Ok(Buf { data, dtype, len })
    }

    /// A buffer holding `bytes` (already in `dtype`'s encoding).
    pub fn upload(&self, dtype: DType, bytes: &[u8]) -> Result<Buf> {
        if !bytes.len().is_multiple_of(dtype.size()) {
            return Err(shape(
                "upload",
                format!("{} bytes are not whole {dtype:?} elements", bytes.len()),
            ));
        }
        let data = if bytes.is_empty() {
            self.stream.alloc_zeros::<u8>(1)
        } else {
            self.stream.clone_htod(bytes)
        }
        .map_err(drv("cuMemcpyHtoD"))?;
        Ok(Buf {
            data,
            dtype,
            len: bytes.len() / dtype.size(),
        })
    }

    pub fn upload_f32(&self, dtype: DType, x: &[f32]) -> Result<Buf> {
        self.upload(dtype, &encode(dtype, x))
    }

    pub fn upload_f32_slice(&self, x: &[f32]) -> Result<CudaSlice<f32>> {
        self.stream.clone_htod(x).map_err(drv("cuMemcpyHtoD"))
    }

    /// Waits for the stream, then copies `b` back as f32.
    pub fn download(&self, b: &Buf) -> Result<Vec<f32>> {
        let bytes = self.download_bytes(b)?;
        Ok(decode(b.dtype, &bytes))
    }

    pub fn download_bytes(&self, b: &Buf) -> Result<Vec<u8>> {
        self.synchronize()?;
        let mut v = self
            .stream
            .clone_dtoh(&b.data)
            .map_err(drv("cuMemcpyDtoH"))?;
        v.truncate(b.bytes());
        Ok(v)
    }

    fn func(&self, entry: &str) -> Result<&CudaFunction> {
        self.funcs.get(entry).ok_or_else(|| CudaError::Driver {
            call: "cuModuleGetFunction",
            message: format!("no kernel entry {entry}"),
        })
    }

    /// Launches `entry` (asynchronously, on the stream).
    pub fn launch(&self, entry: &str, l: Launch, args: &[Arg]) -> Result<()> {
        let f = self.func(entry)?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Buf(s) => b.arg(&s.data),
                Arg::Raw(s) => b.arg(*s),
                Arg::F32s(s) => b.arg(*s),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::U64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: every caller below passes the argument list of the
        // kernel's signature in kernels/, with buffers of the sizes the
        // launch geometry covers.
        unsafe { b.launch(l.to_cudarc()) }.map_err(drv("cuLaunchKernel"))?;
        Ok(())
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

    /// `out[t] = table[ids[t]]` (also: gathering rows of an activation).
    pub fn embedding(
        &self,
        ids: &Buf,
        table: &Buf,
        out: &Buf,
        n: usize,
        hidden: usize,
    ) -> Result<()> {
        Self::same("embedding", table, out)?;
        Self::need("embedding", out, n * hidden)?;
        self.launch(
            &format!("embedding_{}", out.dtype.suffix()),
            geometry::embedding(n, hidden)?,
            &[
                Arg::Buf(ids),
                Arg::Buf(table),
                Arg::Buf(out),
                Arg::I32(hidden as i32),
            ],
        )
    }

    pub fn rmsnorm(
        &self,
        x: &Buf,
        w: &Buf,
        out: &Buf,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        Self::same("rmsnorm", x, out)?;
        Self::same("rmsnorm", x, w)?;
        Self::need("rmsnorm", out, rows * hidden)?;
        self.launch(
            &format!("rmsnorm_{}", x.dtype.suffix()),
            geometry::rmsnorm(rows, hidden)?,
            &[
                Arg::Buf(x),
                Arg::Buf(w),
                Arg::Buf(out),
                Arg::I32(hidden as i32),
                Arg::F32(eps),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &Buf,
        positions: &Buf,
        inv_freq: &CudaSlice<f32>,
        n: usize,
        heads: usize,
        head_dim: usize,
        interleaved: bool,
    ) -> Result<()> {
        Self::need("rope", x, n * heads * head_dim)?;
        self.launch(
            &format!("rope_{}", x.dtype.suffix()),
            geometry::rope(n, heads, head_dim)?,
            &[
                Arg::Buf(x),
                Arg::Buf(positions),
                Arg::F32s(inv_freq),
                Arg::I32(n as i32),
                Arg::I32(heads as i32),
                Arg::I32(head_dim as i32),
                Arg::I32(interleaved as i32),
            ],
        )
    }

    pub fn silu_mul(&self, gate: &Buf, up: &Buf, out: &Buf, n: usize) -> Result<()> {
        Self::same("silu_mul", gate, up)?;
        Self::need("silu_mul", out, n)?;
        self.launch(
            &format!("silu_mul_{}", out.dtype.suffix()),
            geometry::elementwise("silu_mul", n)?,
            &[
                Arg::Buf(gate),
                Arg::Buf(up),
                Arg::Buf(out),
                Arg::I64(n as i64),
            ],
        )
    }

    /// `x += b` elementwise over `n` elements.
    pub fn add_into(&self, x: &Buf, b: &Buf, n: usize) -> Result<()> {
        Self::same("residual_add", x, b)?;
        Self::need("residual_add", x, n)?;
        self.launch(
            &format!("residual_add_{}", x.dtype.suffix()),
            geometry::elementwise("residual_add", n)?,
            &[Arg::Buf(x), Arg::Buf(b), Arg::Buf(x), Arg::I64(n as i64)],
        )
    }

    /// `x[r, i] += bias[i]` for `rows` rows of `cols`.
    pub fn bias_add(&self, x: &Buf, bias: &Buf, rows: usize, cols: usize) -> Result<()> {
        Self::same("bias_add", x, bias)?;
        self.launch(
            &format!("bias_add_{}", x.dtype.suffix()),
            geometry::elementwise("bias_add", rows * cols)?,
            &[
                Arg::Buf(x),
                Arg::Buf(bias),
                Arg::I64((rows * cols) as i64),
                Arg::I32(cols as i32),
            ],
        )
    }

    /// Writes `n` tokens' K and V rows into their cache slots.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        k: &Buf,
        v: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        slots: &Buf,
        n: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.launch(
            &format!("kv_append_{}_{}", k.dtype.suffix(), k_cache.dtype.suffix()),
            geometry::kv_append(n, kv_heads, head_dim)?,
            &[
                Arg::Buf(k),
                Arg::Buf(v),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(slots),
                Arg::I32((kv_heads * head_dim) as i32),
            ],
        )
    }

    /// Decode attention: one query row per sequence. Split over partitions
    /// of the keys, and merged by a second launch, when
    /// [`geometry::decode_partitions`] says so (long tables, few sequences).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode(
        &self,
        out: &Buf,
        q: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        tables: &Buf,
        context_lens: &Buf,
        a: AttnDims,
    ) -> Result<()> {
        let parts =
            geometry::decode_partitions(a.num_seqs, a.heads, a.max_blocks_per_seq, a.block_size);
        let partials = if parts > 1 {
            Some(self.empty(
                DType::F32,
                geometry::decode_partials_len(a.num_seqs, a.heads, a.head_dim, parts),
            )?)
        } else {
            None
        };
        let mut args = a.with_shape(&[
            Arg::Buf(out),
            Arg::Buf(q),
            Arg::Buf(k_cache),
            Arg::Buf(v_cache),
            Arg::Buf(tables),
            Arg::Buf(context_lens),
        ]);
        // Unsplit, the kernel does not read `partials`: a null pointer.
        args.push(partials.as_ref().map_or(Arg::U64(0), Arg::Buf));
        args.push(Arg::I32(geometry::DECODE_PARTITION as i32));
        self.launch(
            &format!(
                "paged_attention_decode_{}_{}",
                q.dtype.suffix(),
                k_cache.dtype.suffix()
            ),
            geometry::paged_decode(a.num_seqs, a.heads, a.kv_heads, a.head_dim, parts)?,
            &args,
        )?;
        if let Some(p) = &partials {
            self.launch(
                &format!("paged_attention_merge_{}", out.dtype.suffix()),
                geometry::paged_merge(a.num_seqs, a.heads)?,
                &[
                    Arg::Buf(out),
                    Arg::Buf(p),
                    Arg::I32(a.heads as i32),
                    Arg::I32(a.head_dim as i32),
                    Arg::I32(parts as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// Prefill (and mixed) attention over query rows `cu_q_lens`.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill(
        &self,
        out: &Buf,
        q: &Buf,
        k_cache: &Buf,
        v_cache: &Buf,
        tables: &Buf,
        cu_q_lens: &Buf,
        context_lens: &Buf,
        max_q_len: usize,
        a: AttnDims,
    ) -> Result<()> {
        self.launch(
            &format!(
                "prefill_attention_{}_{}",
                q.dtype.suffix(),
                k_cache.dtype.suffix()
            ),
            geometry::prefill(a.num_seqs, max_q_len, a.heads, a.kv_heads, a.head_dim)?,
            &a.with_shape(&[
                Arg::Buf(out),
                Arg::Buf(q),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(tables),
                Arg::Buf(cu_q_lens),
                Arg::Buf(context_lens),
            ]),
        )
    }

    /// GGUF blocks (`q4_0`, `q4_1`, `q8_0`) to `out`'s dtype.
    pub fn dequant(&self, format: &str, blocks: &Buf, out: &Buf, n_blocks: usize) -> Result<()> {
        Self::need("dequant", out, n_blocks * 32)?;
        self.launch(
            &format!("dequant_{format}_{}", out.dtype.suffix()),
            geometry::dequant(n_blocks)?,
            &[Arg::Buf(blocks), Arg::Buf(out), Arg::I64(n_blocks as i64)],
        )
    }

    /// Fills `out` with the dummy values of key `key` (see kernels/dummy.cu).
    pub fn dummy_fill(&self, out: &Buf, key: u64, scale: f32) -> Result<()> {
        self.launch(
            &format!("dummy_fill_{}", out.dtype.suffix()),
            geometry::elementwise("dummy_fill", out.len)?,
            &[
                Arg::Buf(out),
                Arg::I64(out.len as i64),
                Arg::U64(key),
                Arg::F32(scale),
            ],
        )
    }

    /// Per-tensor e4m3 quantisation of the first `n` elements of `x` into
    /// `out` (scale written on the device).
    pub fn quantize_fp8_into(&self, x: &Buf, n: usize, out: &Fp8Buf) -> Result<()> {
        // alloc_zeros: the absmax kernel's atomicMax starts from 0.
        let amax = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(drv("cuMemAlloc"))?;
        let blocks = n
            .div_ceil(geometry::ELEMENTWISE_THREADS as usize)
            .clamp(1, 1024);
        let l = Launch {
            grid: (blocks as u32, 1, 1),
            block: (geometry::ELEMENTWISE_THREADS, 1, 1),
            shared_bytes: 0,
        };
        let sfx = x.dtype.suffix();
        self.launch(
            &format!("absmax_{sfx}"),
            l,
            &[Arg::Buf(x), Arg::I64(n as i64), Arg::F32s(&amax)],
        )?;
        self.launch(
            &format!("quant_fp8_{sfx}"),
            geometry::elementwise("quant_fp8", n)?,
            &[
                Arg::Buf(x),
                Arg::Buf(&out.data),
                Arg::I64(n as i64),
                Arg::F32s(&amax),
                Arg::F32s(&out.scale),
            ],
        )
    }

    pub fn fp8_buf(&self, len: usize) -> Result<Fp8Buf> {
        Ok(Fp8Buf {
            data: self.zeros(DType::Fp8, len)?,
            scale: self
                .stream
                .alloc_zeros::<f32>(1)
                .map_err(drv("cuMemAlloc"))?,
        })
    }

    /// Copies `bytes` into the start of `dst` (a decode graph's fixed
    /// buffers), on the stream.
    pub fn write(&self, dst: &mut Buf, bytes: &[u8]) -> Result<()> {
        if bytes.len() > dst.bytes() {
            return Err(shape(
                "write",
                format!("{} bytes into a buffer of {}", bytes.len(), dst.bytes()),
            ));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let mut view = dst.data.slice_mut(0..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .map_err(drv("cuMemcpyHtoD"))
    }

    /// [`Gpu::sample`] with the parameters already on the device and the
    /// tokens left there (`params`: f32 `[rows * 3]`, `out`: u32 `[rows]`);
    /// nothing is copied, so a graph can capture it.
    pub fn sample_into(
        &self,
        logits: &Buf,
        rows: usize,
        vocab: usize,
        params: &Buf,
        out: &Buf,
    ) -> Result<()> {
        Self::need("sample", logits, rows * vocab)?;
        Self::need("sample", params, rows * 3)?;
        Self::need("sample", out, rows)?;
        self.launch(
            &format!("sample_{}", logits.dtype.suffix()),
            geometry::sampling(rows)?,
            &[
                Arg::Buf(logits),
                Arg::Buf(out),
                Arg::I32(vocab as i32),
                Arg::Buf(params),
            ],
        )
    }

    /// One token per row of `[rows, vocab]` logits, picked per row by
    /// `params[3 row ..] = (temperature, top_p, u)`: greedy (the lowest
    /// index on a tie) when temperature <= 0, else top-p at the uniform u
    /// (`kernels/sampling.cu`).
    pub fn sample(
        &self,
        logits: &Buf,
        rows: usize,
        vocab: usize,
        params: &[f32],
    ) -> Result<Vec<u32>> {
        if params.len() != rows * 3 {
            return Err(shape(
                "sample",
                format!("{} parameters for {rows} rows (3 per row)", params.len()),
            ));
        }
        Self::need("sample", logits, rows * vocab)?;
        let p = self.upload_f32(DType::F32, params)?;
        let out = self.zeros(DType::U32, rows)?;
        self.sample_into(logits, rows, vocab, &p, &out)?;
        let b = self.download_bytes(&out)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Shape of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub num_seqs: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

impl AttnDims {
    /// `buffers` followed by the scalar tail both attention kernels take:
    /// `max_blocks_per_seq, num_heads, num_kv_heads, head_dim, block_size,
    /// scale`.
    fn with_shape<'a>(&self, buffers: &[Arg<'a>]) -> Vec<Arg<'a>> {
        let mut v = buffers.to_vec();
        v.extend([
            Arg::I32(self.max_blocks_per_seq as i32),
            Arg::I32(self.heads as i32),
            Arg::I32(self.kv_heads as i32),
            Arg::I32(self.head_dim as i32),
            Arg::I32(self.block_size as i32),
            Arg::F32(1.0 / (self.head_dim as f32).sqrt()),
        ]);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_encodings_round_trip() {
        let x = [0.5f32, -1.25, 3.0];
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            assert_eq!(decode(dt, &encode(dt, &x)), x.to_vec());
        }
        assert_eq!(decode(DType::Fp8, &[crate::fp8::encode(1.5)]), vec![1.5]);
        assert_eq!(
            le_bytes(&[1u32, 2], u32::to_le_bytes),
            vec![1, 0, 0, 0, 2, 0, 0, 0]
        );
    }

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
