//! `gemm.cu` (the GEMMs of a machine without cuBLAS) through the runtime's
//! [`Gpu::gemm_kernels`](crate::runtime::Gpu::gemm_kernels) and
//! [`Gpu::gemm_fp8_kernels`](crate::runtime::Gpu::gemm_fp8_kernels): every
//! dtype pair on shapes that cover a decode row (the `gemm_small_*`
//! entries), partial tiles, an inner size that is not a multiple of 8 (the
//! scalar load path) and the fused residual add.

use super::check::{round, Cx};
use crate::reference as r;
use crate::runtime::{gemm_kernel_entry, DType, Fp8Buf};

pub(super) fn cases(cx: &mut Cx) {
    // (rows, inner, out, accumulate): up to 8 rows run gemm_small_*.
    let shapes: [(usize, usize, usize, bool); 7] = [
        (1, 64, 96, false),
        (70, 200, 130, false),
        (37, 100, 45, false),
        (128, 512, 256, true),
        (1, 4096, 24, false),
        (5, 100, 45, false),
        (8, 1000, 33, true),
    ];
    for (rows, inner, out, acc) in shapes {
        let name = format!("gemm {rows}x{inner}x{out}{}", if acc { " +y" } else { "" });
        for (dt, odt) in [
            (DType::F32, DType::F32),
            (DType::F16, DType::F16),
            (DType::F16, DType::F32),
            (DType::Bf16, DType::Bf16),
            (DType::Bf16, DType::F32),
        ] {
            dense(cx, &name, (rows, inner, out), acc, (dt, odt));
        }
        fp8(cx, &name, (rows, inner, out));
    }
}

fn dense(
    cx: &mut Cx,
    name: &str,
    dims: (usize, usize, usize),
    acc: bool,
    (dt, odt): (DType, DType),
) {
    let (rows, inner, out) = dims;
    let x = round(dt, &cx.rng.vec(rows * inner, 0.5));
    let w = round(dt, &cx.rng.vec(out * inner, 0.5));
    let y0 = round(odt, &cx.rng.vec(rows * out, 1.0));
    let want = round(odt, &r::gemm_tn(&x, &w, acc.then_some(&y0[..]), dims, 1.0));
    let entry = gemm_kernel_entry(dt, odt, rows);
    let g = cx.gpu;
    let got = (|| {
        let (xb, wb) = (g.upload_f32(dt, &x)?, g.upload_f32(dt, &w)?);
        let yb = g.upload_f32(odt, &y0)?;
        g.gemm_kernels(&xb, &wb, &yb, rows, inner, out, acc)?;
        g.download(&yb)
    })();
    cx.check(name, &entry, odt, got, &want, None);
}

/// Random e4m3 codes (no NaN) and per-tensor scales, bf16 out.
fn fp8(cx: &mut Cx, name: &str, dims: (usize, usize, usize)) {
    let (rows, inner, out) = dims;
    let mut code = || loop {
        let b = cx.rng.below(256) as u8;
        if b & 0x7f != 0x7f {
            break b;
        }
    };
    let qx: Vec<u8> = (0..rows * inner).map(|_| code()).collect();
    let qw: Vec<u8> = (0..out * inner).map(|_| code()).collect();
    let (sx, sw) = (0.0123f32, 0.00456f32);
    let dec = |q: &[u8]| q.iter().map(|&b| crate::fp8::decode(b)).collect::<Vec<_>>();
    let want = round(
        DType::Bf16,
        &r::gemm_tn(&dec(&qx), &dec(&qw), None, dims, sx * sw),
    );
    let entry = gemm_kernel_entry(DType::Fp8, DType::Bf16, rows);
    let g = cx.gpu;
    let got = (|| {
        let x = Fp8Buf {
            data: g.upload(DType::Fp8, &qx)?,
            scale: g.upload_f32_slice(&[sx])?,
        };
        let w = Fp8Buf {
            data: g.upload(DType::Fp8, &qw)?,
            scale: g.upload_f32_slice(&[sw])?,
        };
        let yb = g.zeros(DType::Bf16, rows * out)?;
        g.gemm_fp8_kernels(&x, &w, &yb, rows, inner, out)?;
        g.download(&yb)
    })();
    cx.check(
        name,
        &entry,
        DType::Bf16,
        got,
        &want,
        Some("e4m3 x e4m3, scales 0.0123 and 0.00456".into()),
    );
}
