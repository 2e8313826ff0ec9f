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

/// Column-major GEMM parameters in BLAS terms: `C(m x n) = op(A) op(B)`
/// with `op = T` meaning transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmDesc {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

/// `y[rows, out] = x[rows, inner] W[out, inner]^T`, all row-major, as a
/// column-major BLAS call with `A = W`, `B = x`, `C = y`: a row-major
/// `[r, c]` matrix is a column-major `c x r` one with leading dimension `c`,
/// so `y^T (out x rows) = W (out x inner, from A^T) x^T (inner x rows)`.
pub fn linear_gemm(rows: usize, inner: usize, out: usize) -> GemmDesc {
    GemmDesc {
        trans_a: true,
        trans_b: false,
        m: out,
        n: rows,
        k: inner,
        lda: inner,
        ldb: inner,
        ldc: out,
    }
}

/// A plain column-major GEMM with BLAS semantics (reference for the tests
/// of [`linear_gemm`]): `C = op(A) op(B) + beta C`.
pub fn blas_gemm_reference(d: GemmDesc, a: &[f32], b: &[f32], c: &mut [f32], beta: f32) {
    let at = |i: usize, l: usize| {
        if d.trans_a {
            a[l + i * d.lda]
        } else {
            a[i + l * d.lda]
        }
    };
    let bt = |l: usize, j: usize| {
        if d.trans_b {
            b[j + l * d.ldb]
        } else {
            b[l + j * d.ldb]
        }
    };
    for j in 0..d.n {
        for i in 0..d.m {
            let s: f32 = (0..d.k).map(|l| at(i, l) * bt(l, j)).sum();
            let ci = &mut c[i + j * d.ldc];
            *ci = s + beta * *ci;
        }
    }
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

/// A cached cuBLASLt plan for one fp8 GEMM shape.
struct LtPlan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    d: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the handles are plain pointers owned by the plan; the plan is only
// used under the runtime's mutex.
unsafe impl Send for LtPlan {}

struct Lt {
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<(usize, usize, usize), LtPlan>,
}

// SAFETY: as for LtPlan.
unsafe impl Send for Lt {}

impl Lt {
    fn clear_plans(&mut self) {
        use cudarc::cublaslt::result as r;
        // SAFETY: each handle was created by cuBLASLt and is destroyed once;
        // a matmul already queued keeps its own copy of the descriptor.
        unsafe {
            for (_, p) in self.plans.drain() {
                let _ = r::destroy_matrix_layout(p.a);
                let _ = r::destroy_matrix_layout(p.b);
                let _ = r::destroy_matrix_layout(p.d);
                let _ = r::destroy_matmul_desc(p.desc);
            }
        }
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        self.clear_plans();
        // SAFETY: created by cublasLtCreate, destroyed once.
        unsafe {
            let _ = cudarc::cublaslt::result::destroy_handle(self.handle);
        }
    }
}

type DescAttr = lt_sys::cublasLtMatmulDescAttributes_t;

/// Sets one cuBLASLt matmul-descriptor attribute from a plain value.
///
/// # Safety
/// `desc` is a live descriptor and `T` is the attribute's documented type.
unsafe fn set_desc<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: DescAttr,
    value: &T,
) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
    cudarc::cublaslt::result::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
}

/// fp8 GEMM plans kept at once (one per distinct shape).
const MAX_LT_PLANS: usize = 256;

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

    /// Decode attention: one query row per sequence.
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
        self.launch(
            &format!(
                "paged_attention_decode_{}_{}",
                q.dtype.suffix(),
                k_cache.dtype.suffix()
            ),
            geometry::paged_decode(a.num_seqs, a.heads, a.kv_heads, a.head_dim)?,
            &a.with_shape(&[
                Arg::Buf(out),
                Arg::Buf(q),
                Arg::Buf(k_cache),
                Arg::Buf(v_cache),
                Arg::Buf(tables),
                Arg::Buf(context_lens),
            ]),
        )
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

    /// `y[rows, out] (+)= x[rows, inner] W[out, inner]^T` with cuBLAS
    /// (`accumulate`: beta = 1, the residual add fused into the GEMM). `y`
    /// may be f32 when `x` and `W` are 16-bit (the logits).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        x: &Buf,
        w: &Buf,
        y: &Buf,
        rows: usize,
        inner: usize,
        out: usize,
        accumulate: bool,
    ) -> Result<()> {
        let Some(blas) = &self.blas else {
            return self.gemm_kernels(x, w, y, rows, inner, out, accumulate);
        };
        Self::dense_operands(x, w, y, rows, inner, out)?;
        self.bind()?;
        let d = linear_gemm(rows, inner, out);
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let op = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (a_ptr, _ra) = w.data.device_ptr(&self.stream);
        let (b_ptr, _rb) = x.data.device_ptr(&self.stream);
        let (c_ptr, _rc) = y.data.device_ptr(&self.stream);
        // SAFETY: the buffers hold the elements checked above; the
        // descriptor is linear_gemm's, tested against a reference GEMM.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                op(d.trans_a),
                op(d.trans_b),
                d.m as i32,
                d.n as i32,
                d.k as i32,
                &alpha as *const f32 as *const c_void,
                a_ptr as *const c_void,
                w.dtype.blas()?,
                d.lda as i32,
                b_ptr as *const c_void,
                x.dtype.blas()?,
                d.ldb as i32,
                &beta as *const f32 as *const c_void,
                c_ptr as *mut c_void,
                y.dtype.blas()?,
                d.ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("cublasGemmEx"))
    }

    /// `y[rows, out] = (sx x8)[rows, inner] (sw W8)[out, inner]^T` with
    /// e4m3 operands and per-tensor scales (cuBLASLt, "TN"), `y` in bf16.
    pub fn gemm_fp8(
        &self,
        x: &Fp8Buf,
        w: &Fp8Buf,
        y: &Buf,
        rows: usize,
        inner: usize,
        out: usize,
    ) -> Result<()> {
        use cudarc::cublaslt::result as r;
        if !self.info.fp8 {
            return Err(shape(
                "gemm_fp8",
                format!(
                    "fp8 GEMMs need compute capability 8.9 or newer; this device has {}.{}",
                    self.device.info.compute_capability.0, self.device.info.compute_capability.1
                ),
            ));
        }
        Self::fp8_operands(x, w, y, rows, inner, out)?;
        let Some(lt) = self.lt.as_ref() else {
            return self.gemm_fp8_kernels(x, w, y, rows, inner, out);
        };
        if !inner.is_multiple_of(16) || !out.is_multiple_of(16) {
            return Err(shape(
                "gemm_fp8",
                format!("cuBLASLt fp8 needs inner ({inner}) and out ({out}) multiples of 16"),
            ));
        }
        self.bind()?;
        let mut lt = lt
            .lock()
            .map_err(|_| shape("gemm_fp8", "lock poisoned".into()))?;
        let d = linear_gemm(rows, inner, out);
        let key = (rows, inner, out);
        let (sa, _r1) = w.scale.device_ptr(&self.stream);
        let (sb, _r2) = x.scale.device_ptr(&self.stream);
        if !lt.plans.contains_key(&key) {
            // Prefill lengths vary: keep the cache bounded.
            if lt.plans.len() >= MAX_LT_PLANS {
                lt.clear_plans();
            }
            let handle = lt.handle;
            let ws = lt.workspace.len();
            let plan = (|| -> std::result::Result<LtPlan, cudarc::cublaslt::result::CublasError> {
                let desc = r::create_matmul_desc(
                    lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt_sys::cudaDataType::CUDA_R_32F,
                )?;
                let t: i32 = 1;
                let n: i32 = 0;
                // SAFETY: attribute values are the documented types (i32 ops).
                unsafe {
                    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, &t)?;
                    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, &n)?;
                    // The scale pointers are part of the problem the
                    // heuristic sees (NVIDIA's LtFp8Matmul sets them first);
                    // they are set again before every call.
                    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa)?;
                    set_desc(desc, DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb)?;
                }
                // A = W: col-major inner x out (ld inner), used transposed.
                let a = r::create_matrix_layout(DType::Fp8.lt(), d.k as u64, d.m as u64, d.lda as i64)?;
                // B = x: col-major inner x rows (ld inner).
                let b = r::create_matrix_layout(DType::Fp8.lt(), d.k as u64, d.n as u64, d.ldb as i64)?;
                // C = D = y: col-major out x rows (ld out), bf16.
                let dl = r::create_matrix_layout(DType::Bf16.lt(), d.m as u64, d.n as u64, d.ldc as i64)?;
                let pref = r::create_matmul_pref()?;
                // SAFETY: handles created above; the heuristic reads them.
                let heur = unsafe {
                    r::set_matmul_pref_attribute(
                        pref,
                        lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &ws as *const usize as *const c_void,
                        std::mem::size_of::<usize>(),
                    )?;
                    let h = r::get_matmul_algo_heuristic(handle, desc, a, b, dl, dl, pref);
                    let _ = r::destroy_matmul_pref(pref);
                    h?
                };
                Ok(LtPlan {
                    desc,
                    a,
                    b,
                    d: dl,
                    algo: heur.algo,
                })
            })()
            .map_err(lt_err("cublasLt fp8 plan"))?;
            lt.plans.insert(key, plan);
        }
        let plan = &lt.plans[&key];
        let (a_ptr, _r3) = w.data.data.device_ptr(&self.stream);
        let (b_ptr, _r4) = x.data.data.device_ptr(&self.stream);
        let (y_ptr, _r5) = y.data.device_ptr(&self.stream);
        let (ws_ptr, _r6) = lt.workspace.device_ptr(&self.stream);
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: the plan's layouts match the buffers' shapes (checked by
        // the caller's shapes); scale pointers are device f32 values.
        unsafe {
            set_desc(
                plan.desc,
                DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &sa,
            )
            .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
            set_desc(
                plan.desc,
                DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &sb,
            )
            .map_err(lt_err("cublasLtMatmulDescSetAttribute"))?;
            r::matmul(
                lt.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a_ptr as *const c_void,
                plan.a,
                b_ptr as *const c_void,
                plan.b,
                y_ptr as *const c_void,
                plan.d,
                y_ptr as *mut c_void,
                plan.d,
                &plan.algo,
                ws_ptr as *mut c_void,
                lt.workspace.len(),
                self.stream.cu_stream() as *mut _,
            )
            .map_err(lt_err("cublasLtMatmul"))
        }
    }

    /// The checks of a 16-bit or f32 GEMM: same operand dtypes (fp8 has its
    /// own call, with scales), and buffers that hold the shapes.
    fn dense_operands(
        x: &Buf,
        w: &Buf,
        y: &Buf,
        rows: usize,
        inner: usize,
        out: usize,
    ) -> Result<()> {
        Self::same("gemm", x, w)?;
        if !matches!(x.dtype, DType::F32 | DType::F16 | DType::Bf16) {
            return Err(shape(
                "gemm",
                format!("{:?} operands: use gemm_fp8 for fp8", x.dtype),
            ));
        }
        Self::need("gemm", x, rows * inner)?;
        Self::need("gemm", w, out * inner)?;
        Self::need("gemm", y, rows * out)
    }

    /// Whether GEMMs run on cuBLAS (else on `kernels/gemm.cu`).
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// [`Gpu::gemm`] on `kernels/gemm.cu` even where cuBLAS is loaded (the
    /// GEMM benchmark compares the two).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_kernels(
        &self,
        x: &Buf,
        w: &Buf,
        y: &Buf,
        rows: usize,
        inner: usize,
        out: usize,
        accumulate: bool,
    ) -> Result<()> {
        Self::dense_operands(x, w, y, rows, inner, out)?;
        let entry = format!("gemm_{}_{}", x.dtype.suffix(), y.dtype.suffix());
        self.gemm_kernel(&entry, x, w, y, (rows, inner, out), accumulate, None)
    }

    /// The checks of an fp8 GEMM: e4m3 operands, bf16 out, buffers that
    /// hold the shapes.
    fn fp8_operands(
        x: &Fp8Buf,
        w: &Fp8Buf,
        y: &Buf,
        rows: usize,
        inner: usize,
        out: usize,
    ) -> Result<()> {
        if y.dtype != DType::Bf16 || x.data.dtype != DType::Fp8 || w.data.dtype != DType::Fp8 {
            return Err(shape(
                "gemm_fp8",
                format!(
                    "fp8 x fp8 -> bf16 only, got {:?} x {:?} -> {:?}",
                    x.data.dtype, w.data.dtype, y.dtype
                ),
            ));
        }
        Self::need("gemm_fp8", &x.data, rows * inner)?;
        Self::need("gemm_fp8", &w.data, out * inner)?;
        Self::need("gemm_fp8", y, rows * out)
    }

    /// [`Gpu::gemm_fp8`] on `kernels/gemm.cu` even where cuBLASLt is loaded.
    pub fn gemm_fp8_kernels(
        &self,
        x: &Fp8Buf,
        w: &Fp8Buf,
        y: &Buf,
        rows: usize,
        inner: usize,
        out: usize,
    ) -> Result<()> {
        Self::fp8_operands(x, w, y, rows, inner, out)?;
        self.gemm_kernel(
            "gemm_fp8_bf16",
            &x.data,
            &w.data,
            y,
            (rows, inner, out),
            false,
            Some((&x.scale, &w.scale)),
        )
    }

    /// The GEMM on `kernels/gemm.cu` (no cuBLAS): `entry` is
    /// `gemm_<x dtype>_<y dtype>` (`gemm_small_...` up to 8 rows); `scales`
    /// the fp8 per-tensor scales of x and W.
    #[allow(clippy::too_many_arguments)]
    fn gemm_kernel(
        &self,
        entry: &str,
        x: &Buf,
        w: &Buf,
        y: &Buf,
        (rows, inner, out): (usize, usize, usize),
        accumulate: bool,
        scales: Option<(&F32Slice, &F32Slice)>,
    ) -> Result<()> {
        let dims = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| shape("gemm", format!("{what} = {v} exceeds i32")))
        };
        // Decode-sized: one warp per output column, W streamed once.
        let small = rows <= geometry::GEMM_SMALL_ROWS;
        let (entry, l) = if small {
            (
                entry.replacen("gemm_", "gemm_small_", 1),
                geometry::gemm_small(rows, out)?,
            )
        } else {
            (
                entry.to_string(),
                geometry::gemm(rows, out, x.dtype == DType::F32)?,
            )
        };
        let mut args = vec![
            Arg::Buf(x),
            Arg::Buf(w),
            Arg::Buf(y),
            Arg::I32(dims(rows, "rows")?),
            Arg::I32(dims(inner, "inner")?),
            Arg::I32(dims(out, "out")?),
            Arg::I32(accumulate as i32),
        ];
        if let Some((sx, sw)) = scales {
            args.push(Arg::F32s(sx));
            args.push(Arg::F32s(sw));
        }
        self.launch(&entry, l, &args)
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

/// A captured and instantiated CUDA graph (the engine's decode steps),
/// replayed on the stream it was captured from.
pub struct Graph {
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
    stream: Arc<CudaStream>,
}

// SAFETY: the handles are plain driver objects, valid on any thread with the
// context bound (every call binds it); a graph is used by one thread at a
// time (the owner of the model), never concurrently.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph.
    pub fn launch(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: exec and stream are live (the graph holds the stream).
        unsafe { cudarc::driver::result::graph::launch(self.exec, self.stream.cu_stream()) }
            .map_err(drv("cuGraphLaunch"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        use cudarc::driver::result::graph;
        let ctx = self.stream.context();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: created by instantiate / end_capture, destroyed once.
        unsafe {
            let _ = graph::exec_destroy(self.exec);
            let _ = graph::destroy(self.graph);
        }
    }
}

impl Gpu {
    /// Whether graphs can hold this device's allocations: stream-ordered
    /// allocation (memory pools), which a capture records as memory nodes.
    pub fn can_capture(&self) -> bool {
        self.device.ctx.has_async_alloc()
    }

    /// Starts capturing the stream's work into a graph instead of running
    /// it. Thread-local mode: a call that cannot be captured (a synchronous
    /// allocation or copy) fails the capture instead of running outside it.
    pub fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream is live and not capturing (end_capture always
        // ends a capture).
        unsafe {
            cudarc::driver::result::stream::begin_capture(
                self.stream.cu_stream(),
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(drv("cuStreamBeginCapture"))
    }

    /// Ends the capture and instantiates the graph, its resources uploaded.
    /// Call it after every [`Gpu::begin_capture`], also when the captured
    /// work failed: the capture is ended whatever happened (an error a drop
    /// stored meanwhile, such as a free the capture refused, is reported,
    /// not allowed to skip the end), so the stream runs work again.
    pub fn end_capture(&self) -> Result<Graph> {
        use cudarc::driver::result::{graph, stream};
        use cudarc::driver::sys;
        let stored = self.device.ctx.check_err();
        // SAFETY: the stream is live; ending a capture that was invalidated
        // returns an error and leaves capture mode.
        let ended = unsafe { stream::end_capture(self.stream.cu_stream()) };
        let g = ended.map_err(|e| CudaError::Driver {
            call: "cuStreamEndCapture",
            message: match &stored {
                Ok(()) => format!("{e:?}"),
                Err(s) => format!("{e:?} (and during the capture: {s:?})"),
            },
        })?;
        if g.is_null() {
            return Err(shape("graph", "the capture recorded nothing".into()));
        }
        let destroy = |e: CudaError| {
            // SAFETY: g came from end_capture and is destroyed once.
            let _ = unsafe { graph::destroy(g) };
            e
        };
        stored.map_err(drv("during the capture")).map_err(destroy)?;
        // SAFETY: g is a valid captured graph.
        let exec = unsafe { graph::instantiate(g, sys::CUgraphInstantiate_flags(0)) }
            .map_err(drv("cuGraphInstantiate"))
            .map_err(destroy)?;
        let out = Graph {
            graph: g,
            exec,
            stream: self.stream.clone(),
        };
        // SAFETY: exec and stream are live.
        unsafe { graph::upload(out.exec, self.stream.cu_stream()) }
            .map_err(drv("cuGraphUpload"))?;
        Ok(out)
    }
}

/// cuBLASLt workspace (NVIDIA recommends 32 MiB on Hopper).
const LT_WORKSPACE: usize = 32 << 20;

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

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::selftest::Rng::new(seed);
        r.vec(n, 1.0)
    }

    /// The BLAS call of linear_gemm computes x W^T for row-major x, W, y:
    /// checked with a column-major reference GEMM that follows BLAS's
    /// transpose and leading-dimension rules, against the row-major product.
    #[test]
    fn linear_gemm_is_x_times_w_transposed() {
        for (rows, inner, out) in [(1, 8, 3), (5, 16, 7), (3, 4, 4)] {
            let x = rnd(rows * inner, 1);
            let w = rnd(out * inner, 2);
            let resid = rnd(rows * out, 3);
            let d = linear_gemm(rows, inner, out);
            for beta in [0.0f32, 1.0] {
                let mut y = resid.clone();
                blas_gemm_reference(d, &w, &x, &mut y, beta);
                for r in 0..rows {
                    for o in 0..out {
                        let want: f32 = (0..inner)
                            .map(|i| x[r * inner + i] * w[o * inner + i])
                            .sum::<f32>()
                            + beta * resid[r * out + o];
                        let got = y[r * out + o];
                        assert!(
                            (want - got).abs() < 1e-5,
                            "{rows}x{inner}x{out} beta {beta}: {want} vs {got}"
                        );
                    }
                }
            }
        }
        // The fp8 requirement: "TN", A transposed, B not.
        let d = linear_gemm(4, 32, 16);
        assert!(d.trans_a && !d.trans_b);
        assert_eq!(
            (d.m, d.n, d.k, d.lda, d.ldb, d.ldc),
            (16, 4, 32, 32, 32, 16)
        );
    }

    /// The other transposes give a different product: the test above can fail.
    #[test]
    fn a_wrong_transpose_is_caught() {
        let (rows, inner, out) = (3, 4, 5);
        let x = rnd(rows * inner, 4);
        let w = rnd(out * inner, 5);
        let mut d = linear_gemm(rows, inner, out);
        d.trans_a = false;
        d.lda = out;
        let mut y = vec![0f32; rows * out];
        blas_gemm_reference(d, &w, &x, &mut y, 0.0);
        let want: f32 = (0..inner).map(|i| x[i] * w[i]).sum();
        assert!((y[0] - want).abs() > 1e-4);
    }

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
