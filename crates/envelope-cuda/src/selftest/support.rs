//! The kernels the CUDA model needs besides the layer operations, through
//! the runtime's methods: dummy weights (must equal the CPU's bit for bit),
//! fp8 quantisation (bytes and scale), the bias add.

use super::check::{round, Cx};
use crate::reference as r;
use crate::runtime::DType;

pub(super) fn cases(cx: &mut Cx) {
    for dt in [DType::F32, DType::F16, DType::Bf16] {
        dummy_fill(cx, dt);
        quantize_fp8(cx, dt);
        bias_add(cx, dt);
    }
}

/// Exact (tolerance 0): the weights CPU and GPU compare on.
fn dummy_fill(cx: &mut Cx, dt: DType) {
    let (n, key, scale) = (70_001, 0xDEAD_BEEF_u64, 0.0625f32);
    let want = round(dt, &r::dummy_fill(key, n, scale));
    let entry = format!("dummy_fill_{}", dt.suffix());
    let g = cx.gpu;
    let got = (|| {
        let o = g.zeros(dt, n)?;
        g.dummy_fill(&o, key, scale)?;
        g.download(&o)
    })();
    let exact = got.as_ref().map(|g| g == &want).unwrap_or(false);
    cx.check(
        "dummy weights 70001 (must be bit-exact)",
        &entry,
        dt,
        got.map(|g| if exact { g } else { vec![f32::NAN; g.len()] }),
        &want,
        Some("exact equality required".into()),
    );
}

/// absmax + quant_fp8 (`quantize_fp8_into`): the dequantised values and
/// the scale.
fn quantize_fp8(cx: &mut Cx, dt: DType) {
    let x = round(dt, &cx.rng.vec(5_000, 3.0));
    let (q, sc) = r::quant_fp8(&x);
    let mut want: Vec<f32> = q.iter().map(|&b| crate::fp8::decode(b) * sc).collect();
    want.push(sc);
    let entry = format!("quant_fp8_{}", dt.suffix());
    let g = cx.gpu;
    let got = (|| {
        let xb = g.upload_f32(dt, &x)?;
        let out = g.fp8_buf(x.len())?;
        g.quantize_fp8_into(&xb, x.len(), &out)?;
        let s_gpu = g.download_f32_slice(&out.scale)?[0];
        let mut v: Vec<f32> = g
            .download_bytes(&out.data)?
            .iter()
            .map(|&b| crate::fp8::decode(b) * s_gpu)
            .collect();
        v.push(s_gpu);
        Ok(v)
    })();
    cx.check("fp8 quantise 5000", &entry, DType::F32, got, &want, None);
}

fn bias_add(cx: &mut Cx, dt: DType) {
    let (rows, cols) = (6, 320);
    let x = round(dt, &cx.rng.vec(rows * cols, 1.0));
    let b = round(dt, &cx.rng.vec(cols, 1.0));
    let want = round(dt, &r::bias_add(&x, &b));
    let entry = format!("bias_add_{}", dt.suffix());
    let g = cx.gpu;
    let got = (|| {
        let (xb, bb) = (g.upload_f32(dt, &x)?, g.upload_f32(dt, &b)?);
        g.bias_add(&xb, &bb, rows, cols)?;
        g.download(&xb)
    })();
    cx.check("bias add 6x320", &entry, dt, got, &want, None);
}
