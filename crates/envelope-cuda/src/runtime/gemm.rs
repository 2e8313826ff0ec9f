//! The GEMMs of [`Gpu`]: cuBLAS (`cublasGemmEx`) and cuBLASLt (fp8) with
//! their descriptors and plan cache, and the same products on
//! `kernels/gemm.cu` when cuBLAS is absent or bypassed.

use super::{blas_err, lt_err, shape, Arg, Buf, DType, F32Slice, Fp8Buf, Gpu};
use crate::error::Result;
use crate::geometry;
use cudarc::cublas::sys as blas_sys;
use cudarc::cublaslt::sys as lt_sys;
use cudarc::driver::{CudaSlice, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;

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

/// The entry of `kernels/gemm.cu` that runs a GEMM of `rows` rows with
/// operands `x` and output `y`: `gemm_<x>_<y>`, or `gemm_small_<x>_<y>` up
/// to [`geometry::GEMM_SMALL_ROWS`] rows (one warp per output column, the
/// weights streamed once: decode). fp8 operands give `gemm_fp8_bf16`.
pub fn gemm_kernel_entry(x: DType, y: DType, rows: usize) -> String {
    let small = if rows <= geometry::GEMM_SMALL_ROWS {
        "small_"
    } else {
        ""
    };
    format!("gemm_{small}{}_{}", x.suffix(), y.suffix())
}

/// A cached cuBLASLt plan for one fp8 GEMM shape.
pub(super) struct LtPlan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    d: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the handles are plain pointers owned by the plan; the plan is only
// used under the runtime's mutex.
unsafe impl Send for LtPlan {}

/// The cuBLASLt handle, its workspace and the plans (made in `Gpu::open`).
pub(super) struct Lt {
    pub(super) handle: lt_sys::cublasLtHandle_t,
    pub(super) workspace: CudaSlice<u8>,
    pub(super) plans: HashMap<(usize, usize, usize), LtPlan>,
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

/// cuBLASLt workspace (NVIDIA recommends 32 MiB on Hopper).
pub(super) const LT_WORKSPACE: usize = 32 << 20;

impl Gpu {
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
        self.gemm_kernel(x, w, y, (rows, inner, out), accumulate, None)
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
            &x.data,
            &w.data,
            y,
            (rows, inner, out),
            false,
            Some((&x.scale, &w.scale)),
        )
    }

    /// The GEMM on `kernels/gemm.cu` (no cuBLAS), the entry of
    /// [`gemm_kernel_entry`]; `scales` the fp8 per-tensor scales of x and W.
    fn gemm_kernel(
        &self,
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
        let entry = gemm_kernel_entry(x.dtype, y.dtype, rows);
        let l = if rows <= geometry::GEMM_SMALL_ROWS {
            geometry::gemm_small(rows, out)?
        } else {
            geometry::gemm(rows, out, x.dtype == DType::F32)?
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::rng::Rng::new(seed);
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
}
