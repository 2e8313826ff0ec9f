//! The GPU self-test behind `envelope cuda-selftest` (and
//! `scripts/device-check.sh`): open the device, compile every kernel with
//! the machine's NVRTC (or take the embedded PTX: [`crate::embedded`]), run
//! each kernel, the GEMM kernels included, on seeded random inputs and compare
//! it with [`crate::reference`], and write `selftest.json`. It has never run
//! on a GPU at the time of writing (no GPU was lent). The same cases run on
//! the CPU emulator ([`crate::emu`], [`run_emulated`]) in CI, which executes
//! every kernel's own source; the CPU side of it (the references, the
//! comparison, the dtype rounding) is unit-tested here.

use crate::device::{Device, DeviceInfo};
use crate::embedded::PtxSource;
use crate::error::{guarded, CudaError, Result};
use crate::geometry;
use crate::kernels::KERNELS;
use crate::reference as r;
use dev::{drv, Arg, Gpu, Mem};

mod dev;
use half::{bf16, f16};
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;

/// Element types the cases run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dt {
    F32,
    F16,
    Bf16,
}

impl Dt {
    fn suffix(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::F16 => "f16",
            Dt::Bf16 => "bf16",
        }
    }
}

/// A tolerance `|gpu - ref| <= atol + rtol * |ref|`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tol {
    pub atol: f32,
    pub rtol: f32,
}

/// Per dtype: f32 allows accumulation-order and `expf`/`cosf` ulp
/// differences; f16 and bf16 allow one rounding of the output (2^-11 and
/// 2^-8 relative) plus the f32 slack, doubled for reductions.
pub fn tolerance(dt: Dt) -> Tol {
    match dt {
        Dt::F32 => Tol {
            atol: 1e-4,
            rtol: 1e-4,
        },
        Dt::F16 => Tol {
            atol: 2e-3,
            rtol: 2e-3,
        },
        Dt::Bf16 => Tol {
            atol: 1.6e-2,
            rtol: 1.6e-2,
        },
    }
}

/// Rounds values through `dt` (what the GPU sees after upload).
pub fn round(dt: Dt, x: &[f32]) -> Vec<f32> {
    match dt {
        Dt::F32 => x.to_vec(),
        Dt::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        Dt::Bf16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
    }
}

pub fn to_bytes(dt: Dt, x: &[f32]) -> Vec<u8> {
    match dt {
        Dt::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dt::F16 => x
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        Dt::Bf16 => x
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

pub fn from_bytes(dt: Dt, b: &[u8]) -> Vec<f32> {
    match dt {
        Dt::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dt::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dt::Bf16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    }
}

/// Largest absolute error, largest error relative to the tolerance (pass
/// when <= 1), and the index of the worst element.
pub fn compare(gpu: &[f32], reference: &[f32], tol: Tol) -> (f32, f32, usize) {
    let mut worst = (0f32, 0f32, 0usize);
    if gpu.len() != reference.len() {
        return (f32::INFINITY, f32::INFINITY, 0);
    }
    for (i, (g, r)) in gpu.iter().zip(reference).enumerate() {
        let err = (g - r).abs();
        let ratio = if err.is_nan() {
            f32::INFINITY
        } else if err == 0.0 {
            0.0
        } else {
            // A zero tolerance (exact cases) makes any difference infinite.
            err / (tol.atol + tol.rtol * r.abs())
        };
        worst.0 = worst.0.max(if err.is_nan() { f32::INFINITY } else { err });
        if ratio > worst.1 {
            worst.1 = ratio;
            worst.2 = i;
        }
    }
    worst
}

/// splitmix64: seeded inputs without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        (self.unit() * 2.0 - 1.0) * a
    }
    pub fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// A random permutation of 0..n.
    pub fn perm(&mut self, n: usize) -> Vec<u32> {
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

/// GGUF blocks with sane f16 scales (no inf/NaN) and random quants.
pub fn random_q_blocks(rng: &mut Rng, fmt: &str, n_blocks: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n_blocks {
        out.extend(f16::from_f32(rng.sym(0.05)).to_le_bytes());
        let rest = match fmt {
            "q4_0" => 16,
            "q4_1" => {
                out.extend(f16::from_f32(rng.sym(0.5)).to_le_bytes());
                16
            }
            _ => 32,
        };
        out.extend((0..rest).map(|_| rng.next_u64() as u8));
    }
    out
}

#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: String,
    pub entry: String,
    pub dtype: Dt,
    pub tolerance: Tol,
    pub elements: usize,
    pub max_abs_err: f32,
    /// Worst error over its tolerance: passes at <= 1.
    pub max_err_over_tol: f32,
    pub passed: bool,
    pub note: Option<String>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompileResult {
    pub file: String,
    pub seconds: f64,
    pub ptx_bytes: usize,
    pub from_cache: bool,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Report {
    pub device: Option<DeviceInfo>,
    pub device_error: Option<String>,
    /// Where the kernels came from (NVRTC or the embedded PTX).
    pub kernels: Option<String>,
    /// Why no kernel could load.
    pub kernels_error: Option<String>,
    pub nvrtc: Option<String>,
    pub nvrtc_version: Option<String>,
    pub include_dir: Option<String>,
    pub arch: Option<String>,
    pub cublas: Option<String>,
    pub compile: Vec<CompileResult>,
    pub cases: Vec<CaseResult>,
    pub passed: usize,
    pub failed: usize,
    pub warnings: Vec<String>,
    /// Set when the cases ran on the CPU emulator instead of a device.
    pub emulated: Option<String>,
    /// Free-form facts the caller adds (NVML readings).
    pub extra: serde_json::Value,
}

impl Report {
    pub fn ok(&self) -> bool {
        (self.device.is_some() || self.emulated.is_some())
            && self.kernels_error.is_none()
            && self.failed == 0
            && self.passed > 0
            && self.compile.iter().all(|c| c.error.is_none())
    }
}

fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

struct Cx<'a> {
    gpu: &'a Gpu,
    rng: Rng,
    out: Vec<CaseResult>,
}

impl Cx<'_> {
    /// Records one comparison.
    fn check(
        &mut self,
        case: &str,
        entry: &str,
        dt: Dt,
        gpu: Result<Vec<f32>>,
        reference: &[f32],
        note: Option<String>,
    ) {
        self.check_tol(case, entry, dt, gpu, reference, note, tolerance(dt));
    }

    /// Token indices and other integers: equal or failed.
    fn check_exact(
        &mut self,
        case: &str,
        entry: &str,
        gpu: Result<Vec<f32>>,
        reference: &[f32],
        note: Option<String>,
    ) {
        let exact = Tol {
            atol: 0.0,
            rtol: 0.0,
        };
        self.check_tol(case, entry, Dt::F32, gpu, reference, note, exact);
    }

    #[allow(clippy::too_many_arguments)]
    fn check_tol(
        &mut self,
        case: &str,
        entry: &str,
        dt: Dt,
        gpu: Result<Vec<f32>>,
        reference: &[f32],
        note: Option<String>,
        tol: Tol,
    ) {
        let res = match gpu {
            Ok(g) => {
                let (abs, ratio, _) = compare(&g, reference, tol);
                CaseResult {
                    case: case.into(),
                    entry: entry.into(),
                    dtype: dt,
                    tolerance: tol,
                    elements: reference.len(),
                    max_abs_err: abs,
                    max_err_over_tol: ratio,
                    passed: ratio <= 1.0,
                    note,
                    error: None,
                }
            }
            Err(e) => CaseResult {
                case: case.into(),
                entry: entry.into(),
                dtype: dt,
                tolerance: tol,
                elements: reference.len(),
                max_abs_err: f32::NAN,
                max_err_over_tol: f32::NAN,
                passed: false,
                note,
                error: Some(e.to_string()),
            },
        };
        self.out.push(res);
    }
}

/// The kernels the CUDA model needs besides the layer operations: dummy
/// weights (must equal the CPU's bit for bit), fp8 quantisation (bytes and
/// scale), bias add.
fn model_support_cases(cx: &mut Cx) {
    for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
        let s = dt.suffix();
        // dummy_fill: exact (tolerance 0): the weights CPU and GPU compare on.
        let (n, key, scale) = (70_001, 0xDEAD_BEEF_u64, 0.0625f32);
        let want = round(dt, &r::dummy_fill(key, n, scale));
        let entry = format!("dummy_fill_{s}");
        let got = (|| {
            let o = cx.gpu.zeros(n * 4)?;
            cx.gpu.launch(
                "dummy.cu",
                &entry,
                geometry::elementwise("dummy_fill", n)?,
                &[
                    Arg::Buf(&o),
                    Arg::I64(n as i64),
                    Arg::U64(key),
                    Arg::F32(scale),
                ],
            )?;
            Ok(cx.gpu.downf(dt, &o)?[..n].to_vec())
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

        // absmax + quant_fp8: the dequantised values and the scale.
        let x = round(dt, &cx.rng.vec(5_000, 3.0));
        let (q, sc) = r::quant_fp8(&x);
        let mut want: Vec<f32> = q.iter().map(|&b| crate::fp8::decode(b) * sc).collect();
        want.push(sc);
        let entry = format!("quant_fp8_{s}");
        let got = (|| {
            let xb = cx.gpu.upf(dt, &x)?;
            let amax = cx.gpu.zeros(4)?;
            let scale = cx.gpu.zeros(4)?;
            let out = cx.gpu.zeros(x.len())?;
            cx.gpu.launch(
                "fp8.cu",
                &format!("absmax_{s}"),
                geometry::elementwise("absmax", x.len())?,
                &[Arg::Buf(&xb), Arg::I64(x.len() as i64), Arg::Buf(&amax)],
            )?;
            cx.gpu.launch(
                "fp8.cu",
                &entry,
                geometry::elementwise("quant_fp8", x.len())?,
                &[
                    Arg::Buf(&xb),
                    Arg::Buf(&out),
                    Arg::I64(x.len() as i64),
                    Arg::Buf(&amax),
                    Arg::Buf(&scale),
                ],
            )?;
            let s_gpu = from_bytes(Dt::F32, &cx.gpu.down(&scale)?)[0];
            let mut v: Vec<f32> = cx.gpu.down(&out)?[..x.len()]
                .iter()
                .map(|&b| crate::fp8::decode(b) * s_gpu)
                .collect();
            v.push(s_gpu);
            Ok(v)
        })();
        cx.check("fp8 quantise 5000", &entry, Dt::F32, got, &want, None);

        // bias_add
        let (rows, cols) = (6, 320);
        let x = round(dt, &cx.rng.vec(rows * cols, 1.0));
        let b = round(dt, &cx.rng.vec(cols, 1.0));
        let want = round(dt, &r::bias_add(&x, &b));
        let entry = format!("bias_add_{s}");
        let got = (|| {
            let (xb, bb) = (cx.gpu.upf(dt, &x)?, cx.gpu.upf(dt, &b)?);
            cx.gpu.launch(
                "residual_add.cu",
                &entry,
                geometry::elementwise("bias_add", rows * cols)?,
                &[
                    Arg::Buf(&xb),
                    Arg::Buf(&bb),
                    Arg::I64((rows * cols) as i64),
                    Arg::I32(cols as i32),
                ],
            )?;
            cx.gpu.downf(dt, &xb)
        })();
        cx.check("bias add 6x320", &entry, dt, got, &want, None);
    }
}

/// `gemm.cu` (the GEMMs of a machine without cuBLAS): every dtype pair on
/// shapes that cover a decode row, partial tiles, an inner size that is not
/// a multiple of 8 (the scalar load path) and the fused residual add.
fn gemm_cases(cx: &mut Cx) {
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
        let dims = (rows, inner, out);
        let name = format!("gemm {rows}x{inner}x{out}{}", if acc { " +y" } else { "" });
        let small = if rows <= geometry::GEMM_SMALL_ROWS {
            "small_"
        } else {
            ""
        };
        for (dt, odt) in [
            (Dt::F32, Dt::F32),
            (Dt::F16, Dt::F16),
            (Dt::F16, Dt::F32),
            (Dt::Bf16, Dt::Bf16),
            (Dt::Bf16, Dt::F32),
        ] {
            let x = round(dt, &cx.rng.vec(rows * inner, 0.5));
            let w = round(dt, &cx.rng.vec(out * inner, 0.5));
            let y0 = round(odt, &cx.rng.vec(rows * out, 1.0));
            let want = round(odt, &r::gemm_tn(&x, &w, acc.then_some(&y0[..]), dims, 1.0));
            let entry = format!("gemm_{small}{}_{}", dt.suffix(), odt.suffix());
            let got = (|| {
                let (xb, wb, yb) = (
                    cx.gpu.upf(dt, &x)?,
                    cx.gpu.upf(dt, &w)?,
                    cx.gpu.upf(odt, &y0)?,
                );
                gemm_launch(cx.gpu, &entry, [&xb, &wb, &yb], dims, acc, None)?;
                Ok(cx.gpu.downf(odt, &yb)?[..rows * out].to_vec())
            })();
            cx.check(&name, &entry, odt, got, &want, None);
        }
        // fp8: random e4m3 codes (no NaN) and per-tensor scales.
        let mut code = || loop {
            let b = cx.rng.below(256) as u8;
            if b & 0x7f != 0x7f {
                break b;
            }
        };
        let fp8_entry = format!("gemm_{small}fp8_bf16");
        let qx: Vec<u8> = (0..rows * inner).map(|_| code()).collect();
        let qw: Vec<u8> = (0..out * inner).map(|_| code()).collect();
        let (sx, sw) = (0.0123f32, 0.00456f32);
        let dec = |q: &[u8]| q.iter().map(|&b| crate::fp8::decode(b)).collect::<Vec<_>>();
        let want = round(
            Dt::Bf16,
            &r::gemm_tn(&dec(&qx), &dec(&qw), None, dims, sx * sw),
        );
        let got = (|| {
            let (xb, wb, yb) = (
                cx.gpu.up(&qx)?,
                cx.gpu.up(&qw)?,
                cx.gpu.zeros(rows * out * 2)?,
            );
            let (sxb, swb) = (cx.gpu.upf(Dt::F32, &[sx])?, cx.gpu.upf(Dt::F32, &[sw])?);
            gemm_launch(
                cx.gpu,
                &fp8_entry,
                [&xb, &wb, &yb],
                dims,
                false,
                Some([&sxb, &swb]),
            )?;
            Ok(cx.gpu.downf(Dt::Bf16, &yb)?[..rows * out].to_vec())
        })();
        cx.check(
            &name,
            &fp8_entry,
            Dt::Bf16,
            got,
            &want,
            Some("e4m3 x e4m3, scales 0.0123 and 0.00456".into()),
        );
    }
}

fn gemm_launch(
    gpu: &Gpu,
    entry: &str,
    [x, w, y]: [&Mem; 3],
    (rows, inner, out): (usize, usize, usize),
    acc: bool,
    scales: Option<[&Mem; 2]>,
) -> Result<()> {
    let mut args = vec![
        Arg::Buf(x),
        Arg::Buf(w),
        Arg::Buf(y),
        Arg::I32(rows as i32),
        Arg::I32(inner as i32),
        Arg::I32(out as i32),
        Arg::I32(acc as i32),
    ];
    if let Some([sx, sw]) = scales {
        args.extend([Arg::Buf(sx), Arg::Buf(sw)]);
    }
    let l = if entry.starts_with("gemm_small_") {
        geometry::gemm_small(rows, out)?
    } else {
        geometry::gemm(rows, out, entry == "gemm_f32_f32")?
    };
    gpu.launch("gemm.cu", entry, l, &args)
}

fn elementwise_cases(cx: &mut Cx) {
    for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
        let s = dt.suffix();
        // embedding
        let (vocab, hidden) = (100, 200);
        let table = round(dt, &cx.rng.vec(vocab * hidden, 1.0));
        let ids: Vec<u32> = (0..7).map(|_| cx.rng.below(vocab) as u32).collect();
        let want = r::embedding(&ids, &table, hidden);
        let entry = format!("embedding_{s}");
        let got = (|| {
            let (t, i, o) = (
                cx.gpu.upf(dt, &table)?,
                cx.gpu.up(&le(&ids, u32::to_le_bytes))?,
                cx.gpu.zeros(want.len() * 4)?,
            );
            cx.gpu.launch(
                "embedding.cu",
                &entry,
                geometry::embedding(ids.len(), hidden)?,
                &[
                    Arg::Buf(&i),
                    Arg::Buf(&t),
                    Arg::Buf(&o),
                    Arg::I32(hidden as i32),
                ],
            )?;
            Ok(cx.gpu.downf(dt, &o)?[..want.len()].to_vec())
        })();
        cx.check("embedding 7 of 100x200", &entry, dt, got, &want, None);

        // rmsnorm
        for hidden in [576, 4096] {
            let rows = 5;
            let x = round(dt, &cx.rng.vec(rows * hidden, 2.0));
            let w = round(dt, &cx.rng.vec(hidden, 1.0));
            let want = round(dt, &r::rmsnorm(&x, &w, 1e-5));
            let entry = format!("rmsnorm_{s}");
            let got = (|| {
                let (xb, wb, o) = (
                    cx.gpu.upf(dt, &x)?,
                    cx.gpu.upf(dt, &w)?,
                    cx.gpu.zeros(x.len() * 4)?,
                );
                cx.gpu.launch(
                    "rmsnorm.cu",
                    &entry,
                    geometry::rmsnorm(rows, hidden)?,
                    &[
                        Arg::Buf(&xb),
                        Arg::Buf(&wb),
                        Arg::Buf(&o),
                        Arg::I32(hidden as i32),
                        Arg::F32(1e-5),
                    ],
                )?;
                Ok(cx.gpu.downf(dt, &o)?[..x.len()].to_vec())
            })();
            cx.check(&format!("rmsnorm 5x{hidden}"), &entry, dt, got, &want, None);
        }

        // rope
        for (interleaved, theta) in [(false, 10_000.0f32), (true, 500_000.0)] {
            let (heads, hd) = (9, 64);
            let pos: Vec<u32> = vec![0, 1, 5, 100, 1000, 4095];
            let x = round(dt, &cx.rng.vec(pos.len() * heads * hd, 1.0));
            let f = r::inv_freq(theta, hd);
            let mut want = x.clone();
            r::rope(&mut want, &pos, &f, heads, interleaved);
            let want = round(dt, &want);
            let entry = format!("rope_{s}");
            let got = (|| {
                let (xb, pb, fb) = (
                    cx.gpu.upf(dt, &x)?,
                    cx.gpu.up(&le(&pos, u32::to_le_bytes))?,
                    cx.gpu.upf(Dt::F32, &f)?,
                );
                cx.gpu.launch(
                    "rope.cu",
                    &entry,
                    geometry::rope(pos.len(), heads, hd)?,
                    &[
                        Arg::Buf(&xb),
                        Arg::Buf(&pb),
                        Arg::Buf(&fb),
                        Arg::I32(pos.len() as i32),
                        Arg::I32(heads as i32),
                        Arg::I32(hd as i32),
                        Arg::I32(interleaved as i32),
                    ],
                )?;
                cx.gpu.downf(dt, &xb)
            })();
            let style = if interleaved {
                "interleaved"
            } else {
                "half-split"
            };
            // Angles up to 4095 rad: cosf of a large argument differs by a
            // few f32 ulps of the angle between implementations.
            cx.check(
                &format!("rope {style} theta {theta}"),
                &entry,
                dt,
                got,
                &want,
                Some("positions up to 4095".into()),
            );
        }

        // silu_mul and residual_add
        let n = 10_000;
        let (a, b) = (
            round(dt, &cx.rng.vec(n, 6.0)),
            round(dt, &cx.rng.vec(n, 2.0)),
        );
        for (file, name, want) in [
            ("silu_mul.cu", "silu_mul", round(dt, &r::silu_mul(&a, &b))),
            (
                "residual_add.cu",
                "residual_add",
                round(dt, &r::residual_add(&a, &b)),
            ),
        ] {
            let entry = format!("{name}_{s}");
            let got = (|| {
                let (ab, bb, o) = (
                    cx.gpu.upf(dt, &a)?,
                    cx.gpu.upf(dt, &b)?,
                    cx.gpu.zeros(n * 4)?,
                );
                cx.gpu.launch(
                    file,
                    &entry,
                    geometry::elementwise(name, n)?,
                    &[
                        Arg::Buf(&ab),
                        Arg::Buf(&bb),
                        Arg::Buf(&o),
                        Arg::I64(n as i64),
                    ],
                )?;
                Ok(cx.gpu.downf(dt, &o)?[..n].to_vec())
            })();
            cx.check(&format!("{name} {n}"), &entry, dt, got, &want, None);
        }

        // dequant
        for fmt in ["q4_0", "q4_1", "q8_0"] {
            let nb = 1000;
            let blocks = random_q_blocks(&mut cx.rng, fmt, nb);
            let want = round(
                dt,
                &match fmt {
                    "q4_0" => r::dequant_q4_0(&blocks),
                    "q4_1" => r::dequant_q4_1(&blocks),
                    _ => r::dequant_q8_0(&blocks),
                },
            );
            let entry = format!("dequant_{fmt}_{s}");
            let got = (|| {
                let (bb, o) = (cx.gpu.up(&blocks)?, cx.gpu.zeros(nb * 32 * 4)?);
                cx.gpu.launch(
                    "dequant.cu",
                    &entry,
                    geometry::dequant(nb)?,
                    &[Arg::Buf(&bb), Arg::Buf(&o), Arg::I64(nb as i64)],
                )?;
                Ok(cx.gpu.downf(dt, &o)?[..nb * 32].to_vec())
            })();
            cx.check(
                &format!("dequant {fmt} {nb} blocks"),
                &entry,
                dt,
                got,
                &want,
                None,
            );
        }
    }
}

/// A paged cache with scattered blocks, filled through kv_append on the GPU
/// (checked against the reference), then read by both attention kernels.
fn attention_cases(cx: &mut Cx) {
    for (act, cache) in [
        (Dt::F32, Dt::F32),
        (Dt::F32, Dt::F16),
        (Dt::F32, Dt::Bf16),
        (Dt::F16, Dt::F16),
        (Dt::Bf16, Dt::Bf16),
    ] {
        for hd in [64, 128] {
            let (heads, kv_heads, bs) = (8, 2, 16);
            let stride = kv_heads * hd;
            let ctx: Vec<usize> = vec![1, 37, 300];
            let q_lens: Vec<usize> = vec![1, 37, 45]; // the third: a chunk after 255 cached tokens
            let num_blocks = 40;
            let perm = cx.rng.perm(num_blocks);
            let mut used = 0;
            let tables: Vec<Vec<u32>> = ctx
                .iter()
                .map(|&n| {
                    let t = perm[used..used + n.div_ceil(bs)].to_vec();
                    used += t.len();
                    t
                })
                .collect();
            // All tokens of all sequences, appended in one kv_append call.
            let mut slots = Vec::new();
            for (t, &n) in tables.iter().zip(&ctx) {
                slots.extend(geometry::slot_mapping(t, 0..n, bs).expect("tables cover ctx"));
            }
            slots.push(-1); // a padding token that must be skipped
            let ntok = slots.len();
            let k = round(act, &cx.rng.vec(ntok * stride, 1.0));
            let v = round(act, &cx.rng.vec(ntok * stride, 1.0));
            let cache_elems = num_blocks * bs * stride;
            let (mut kc, mut vc) = (vec![0f32; cache_elems], vec![0f32; cache_elems]);
            r::kv_append(&k, &v, &mut kc, &mut vc, &slots, stride);
            let (kc, vc) = (round(cache, &kc), round(cache, &vc));
            let entry = format!("kv_append_{}_{}", act.suffix(), cache.suffix());
            let gpu_cache = (|| {
                let (kb, vb) = (cx.gpu.upf(act, &k)?, cx.gpu.upf(act, &v)?);
                let sb = cx.gpu.up(&le(&slots, i64::to_le_bytes))?;
                let (kcb, vcb) = (
                    cx.gpu.zeros(cache_elems * 4)?,
                    cx.gpu.zeros(cache_elems * 4)?,
                );
                cx.gpu.launch(
                    "kv_append.cu",
                    &entry,
                    geometry::kv_append(ntok, kv_heads, hd)?,
                    &[
                        Arg::Buf(&kb),
                        Arg::Buf(&vb),
                        Arg::Buf(&kcb),
                        Arg::Buf(&vcb),
                        Arg::Buf(&sb),
                        Arg::I32(stride as i32),
                    ],
                )?;
                Ok((kcb, vcb))
            })();
            let (kcb, vcb) = match gpu_cache {
                Ok(c) => c,
                Err(e) => {
                    cx.check("kv_append", &entry, cache, Err(e), &kc, None);
                    continue;
                }
            };
            let got = cx.gpu.downf(cache, &kcb).map(|g| g[..cache_elems].to_vec());
            cx.check(
                &format!("kv_append {ntok} tokens hd {hd}"),
                &entry,
                cache,
                got,
                &kc,
                None,
            );
            let refs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
            let flat = geometry::flatten_block_tables(&refs, &ctx, bs).expect("valid tables");
            let sh = r::AttnShape {
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: hd,
                block_size: bs,
                max_blocks_per_seq: flat.max_blocks_per_seq,
            };
            let ctx_i: Vec<i32> = ctx.iter().map(|&n| n as i32).collect();
            let scale = 1.0 / (hd as f32).sqrt();
            // The attention output is rounded to `act`; compare at the coarser of the two dtypes.
            let tol_dt = if act == Dt::Bf16 || cache == Dt::Bf16 {
                Dt::Bf16
            } else if act == Dt::F16 || cache == Dt::F16 {
                Dt::F16
            } else {
                Dt::F32
            };
            let pair = format!("{}_{}", act.suffix(), cache.suffix());

            // Decode: one query per sequence (its last position).
            let q = round(act, &cx.rng.vec(ctx.len() * heads * hd, 1.0));
            let cu1 = geometry::cu_seqlens(&vec![1; ctx.len()]);
            let want = round(
                act,
                &r::paged_attention(&q, &kc, &vc, &flat.data, &cu1, &ctx_i, sh),
            );
            let entry = format!("paged_attention_decode_{pair}");
            // Unsplit (one launch), then split into partitions of 64 keys and
            // merged: the 300-key sequence spans 5, the shorter ones leave
            // partitions past their context empty.
            for part_size in [0, 64] {
                let parts = if part_size == 0 {
                    1
                } else {
                    (flat.max_blocks_per_seq * bs).div_ceil(part_size)
                };
                let got = (|| {
                    let (qb, o) = (cx.gpu.upf(act, &q)?, cx.gpu.zeros(q.len() * 4)?);
                    let (bt, cl) = (
                        cx.gpu.up(&le(&flat.data, i32::to_le_bytes))?,
                        cx.gpu.up(&le(&ctx_i, i32::to_le_bytes))?,
                    );
                    let partials = cx
                        .gpu
                        .zeros(4 * geometry::decode_partials_len(ctx.len(), heads, hd, parts))?;
                    cx.gpu.launch(
                        "paged_attention.cu",
                        &entry,
                        geometry::paged_decode(ctx.len(), heads, kv_heads, hd, parts)?,
                        &[
                            Arg::Buf(&o),
                            Arg::Buf(&qb),
                            Arg::Buf(&kcb),
                            Arg::Buf(&vcb),
                            Arg::Buf(&bt),
                            Arg::Buf(&cl),
                            Arg::I32(flat.max_blocks_per_seq as i32),
                            Arg::I32(heads as i32),
                            Arg::I32(kv_heads as i32),
                            Arg::I32(hd as i32),
                            Arg::I32(bs as i32),
                            Arg::F32(scale),
                            if parts == 1 {
                                Arg::U64(0)
                            } else {
                                Arg::Buf(&partials)
                            },
                            Arg::I32(part_size as i32),
                        ],
                    )?;
                    if parts > 1 {
                        cx.gpu.launch(
                            "paged_attention.cu",
                            &format!("paged_attention_merge_{}", act.suffix()),
                            geometry::paged_merge(ctx.len(), heads)?,
                            &[
                                Arg::Buf(&o),
                                Arg::Buf(&partials),
                                Arg::I32(heads as i32),
                                Arg::I32(hd as i32),
                                Arg::I32(parts as i32),
                            ],
                        )?;
                    }
                    Ok(cx.gpu.downf(act, &o)?[..q.len()].to_vec())
                })();
                cx.check(
                    &format!(
                        "decode attention ctx {ctx:?} hd {hd} gqa {heads}/{kv_heads}{}",
                        if parts > 1 {
                            format!(", {parts} partitions of {part_size} keys")
                        } else {
                            String::new()
                        }
                    ),
                    &entry,
                    tol_dt,
                    got,
                    &want,
                    None,
                );
            }

            // Prefill: whole prompts and a chunk after cached context.
            let total_q: usize = q_lens.iter().sum();
            let q = round(act, &cx.rng.vec(total_q * heads * hd, 1.0));
            let cu = geometry::cu_seqlens(&q_lens);
            let want = round(
                act,
                &r::paged_attention(&q, &kc, &vc, &flat.data, &cu, &ctx_i, sh),
            );
            let entry = format!("prefill_attention_{pair}");
            let got = (|| {
                let (qb, o) = (cx.gpu.upf(act, &q)?, cx.gpu.zeros(q.len() * 4)?);
                let (bt, cl, cub) = (
                    cx.gpu.up(&le(&flat.data, i32::to_le_bytes))?,
                    cx.gpu.up(&le(&ctx_i, i32::to_le_bytes))?,
                    cx.gpu.up(&le(&cu, i32::to_le_bytes))?,
                );
                let max_q = *q_lens.iter().max().unwrap_or(&1);
                cx.gpu.launch(
                    "prefill_attention.cu",
                    &entry,
                    geometry::prefill(ctx.len(), max_q, heads, kv_heads, hd)?,
                    &[
                        Arg::Buf(&o),
                        Arg::Buf(&qb),
                        Arg::Buf(&kcb),
                        Arg::Buf(&vcb),
                        Arg::Buf(&bt),
                        Arg::Buf(&cub),
                        Arg::Buf(&cl),
                        Arg::I32(flat.max_blocks_per_seq as i32),
                        Arg::I32(heads as i32),
                        Arg::I32(kv_heads as i32),
                        Arg::I32(hd as i32),
                        Arg::I32(bs as i32),
                        Arg::F32(scale),
                    ],
                )?;
                Ok(cx.gpu.downf(act, &o)?[..q.len()].to_vec())
            })();
            cx.check(
                &format!("prefill attention q {q_lens:?} ctx {ctx:?} hd {hd}"),
                &entry,
                tol_dt,
                got,
                &want,
                None,
            );
        }
    }
}

fn sampling_cases(cx: &mut Cx) {
    for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
        sampling_case(cx, dt);
    }
}

/// argmax and `sample` on `dt` logits (rounded to it: bf16 makes many
/// ties, which the lowest index must win, as on the CPU).
fn sampling_case(cx: &mut Cx, dt: Dt) {
    let (rows, vocab) = (4, 49_152);
    let mut logits = cx.rng.vec(rows * vocab, 8.0);
    // A tie on row 0: the lower index must win.
    logits[100] = 50.0;
    logits[200] = 50.0;
    let logits = round(dt, &logits);
    let (argmax_entry, sample_entry) = (
        format!("argmax_{}", dt.suffix()),
        format!("sample_{}", dt.suffix()),
    );
    let want: Vec<f32> = logits.chunks(vocab).map(|l| r::argmax(l) as f32).collect();
    let got = (|| {
        let (lb, o) = (cx.gpu.upf(dt, &logits)?, cx.gpu.zeros(rows * 4)?);
        cx.gpu.launch(
            "sampling.cu",
            &argmax_entry,
            geometry::sampling(rows)?,
            &[Arg::Buf(&lb), Arg::Buf(&o), Arg::I32(vocab as i32)],
        )?;
        let b = cx.gpu.down(&o)?;
        Ok(b.chunks_exact(4)
            .take(rows)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect())
    })();
    cx.check_exact(
        &format!("argmax 4x49152 with a tie, {dt:?}"),
        &argmax_entry,
        got,
        &want,
        None,
    );

    // `sample`: per-row (temperature, top_p, u); row 0 greedy (with the
    // tie above), the others top-p at different settings.
    let settings = [(0.0f32, 1.0f32), (0.8, 0.9), (1.3, 0.5), (0.6, 1.0)];
    let mut params = Vec::with_capacity(rows * 3);
    for &(t, p) in &settings {
        params.extend([t, p, cx.rng.unit()]);
    }
    let refs: Vec<Option<r::TopP>> = logits
        .chunks(vocab)
        .zip(params.chunks(3))
        .map(|(l, p)| (p[0] > 0.0).then(|| r::top_p_sample(l, p[0], p[1], p[2])))
        .collect();
    let want: Vec<f32> = logits
        .chunks(vocab)
        .zip(&refs)
        .map(|(l, r)| r.as_ref().map_or(r::argmax(l), |r| r.token) as f32)
        .collect();
    let got = (|| {
        let (lb, pb, o) = (
            cx.gpu.upf(dt, &logits)?,
            cx.gpu.upf(Dt::F32, &params)?,
            cx.gpu.zeros(rows * 4)?,
        );
        cx.gpu.launch(
            "sampling.cu",
            &sample_entry,
            geometry::sampling(rows)?,
            &[
                Arg::Buf(&lb),
                Arg::Buf(&o),
                Arg::I32(vocab as i32),
                Arg::Buf(&pb),
            ],
        )?;
        let b = cx.gpu.down(&o)?;
        Ok(b.chunks_exact(4)
            .take(rows)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect::<Vec<u32>>())
    })();
    // Sums in a different order can move a boundary: a sampled GPU token
    // counts as right when it is in the reference's nucleus (0.1% slack on
    // the threshold); greedy rows must be exact. Exact agreement is in the
    // note.
    let (gpu, note) = match got {
        Ok(toks) => {
            let exact = toks
                .iter()
                .zip(&want)
                .filter(|(t, w)| **t as f32 == **w)
                .count();
            let judged: Vec<f32> = toks
                .iter()
                .zip(&refs)
                .zip(&want)
                .map(|((&t, r), &w)| match r {
                    Some(r)
                        if (t as usize) < vocab && r.weights[t as usize] >= r.threshold * 0.999 =>
                    {
                        w
                    }
                    _ => t as f32,
                })
                .collect();
            (
                Ok(judged),
                Some(format!(
                    "{exact}/{rows} tokens equal to the reference; sampled rows may be anywhere inside its nucleus"
                )),
            )
        }
        Err(e) => (Err(e), None),
    };
    cx.check_exact(
        &format!("sample 4x49152, {dt:?}: greedy, T 0.8 p 0.9, T 1.3 p 0.5, T 0.6 p 1"),
        &sample_entry,
        gpu,
        &want,
        note,
    );
}

/// Runs the whole self-test on device `ordinal` and writes
/// `out_dir/selftest.json`. Each stage's failure is recorded, not fatal.
pub fn run(ordinal: usize, out_dir: &Path, extra: serde_json::Value) -> Report {
    let mut rep = Report {
        extra,
        ..Report::default()
    };
    let device = match Device::open(ordinal) {
        Ok(d) => d,
        Err(e) => {
            rep.device_error = Some(e.to_string());
            write(out_dir, &rep);
            return rep;
        }
    };
    rep.device = Some(device.info.clone());
    let arch = device.arch();
    rep.arch = Some(arch.clone());
    use crate::embedded::GemmChoice;
    let gemm = match GemmChoice::from_env() {
        Ok(g) => g,
        Err(e) => {
            rep.kernels_error = Some(e.to_string());
            write(out_dir, &rep);
            return rep;
        }
    };
    rep.cublas = Some(match gemm {
        GemmChoice::Kernels => {
            "not opened (ENVELOPE_GEMM=kernels: GEMMs on kernels/gemm.cu)".into()
        }
        _ => match crate::libs::probe(crate::libs::CudaLib::CublasLt)
            .and_then(|_| crate::libs::probe(crate::libs::CudaLib::Cublas))
            .and_then(|p| {
                guarded("cublasCreate", || {
                    cudarc::cublas::CudaBlas::new(device.ctx.default_stream())
                })?
                .map(|_| p)
                .map_err(|e| CudaError::Driver {
                    call: "cublasCreate",
                    message: format!("{e:?}"),
                })
            }) {
            Ok(p) => format!("ok: handle created ({p})"),
            Err(e) if gemm == GemmChoice::Cublas => {
                rep.warnings.push(format!(
                    "ENVELOPE_GEMM=cublas but cuBLAS is unavailable: the engine would refuse to start ({e})"
                ));
                format!("unavailable: {e}")
            }
            Err(e) => format!("unavailable: {e} (GEMMs would run on kernels/gemm.cu)"),
        },
    });
    let cc = device.info.compute_capability;
    let source = match PtxSource::choose(cc, &device.info.driver_cuda_version) {
        Ok((source, why)) => {
            rep.warnings.extend(why);
            source
        }
        Err(e) => {
            rep.kernels_error = Some(format!("{e} (no kernel can load, so none ran)"));
            write(out_dir, &rep);
            return rep;
        }
    };
    rep.kernels = Some(source.describe());
    let (ma, mi) = source.nvrtc_version();
    rep.nvrtc_version = Some(format!("{ma}.{mi}"));
    if let PtxSource::Nvrtc(c) = &source {
        rep.nvrtc = Some(c.nvrtc.path.clone());
        rep.include_dir = Some(c.include.display().to_string());
    }
    let stream = device.ctx.default_stream();
    let mut modules = HashMap::new();
    for k in KERNELS {
        let t = std::time::Instant::now();
        let res = source.ptx(k, cc, &arch).and_then(|c| {
            let m = guarded("cuModuleLoadData", || {
                device
                    .ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(c.ptx.clone()))
            })?
            .map_err(drv("cuModuleLoadData"))?;
            modules.insert(k.file, m);
            Ok(c)
        });
        rep.compile.push(CompileResult {
            file: k.file.into(),
            seconds: t.elapsed().as_secs_f64(),
            ptx_bytes: res.as_ref().map(|c| c.ptx.len()).unwrap_or(0),
            from_cache: res.as_ref().map(|c| c.from_cache).unwrap_or(false),
            error: res.err().map(|e| e.to_string()),
        });
    }
    let gpu = Gpu::Cuda { stream, modules };
    rep.cases = run_cases(&gpu);
    rep.passed = rep.cases.iter().filter(|c| c.passed).count();
    rep.failed = rep.cases.len() - rep.passed;
    write(out_dir, &rep);
    rep
}

/// The self-test's cases on the CPU emulator ([`crate::emu`]): every kernel
/// file compiled by the host C++ compiler and run, with the same inputs and
/// tolerances as on a GPU. Writes `out_dir/selftest.json` when given.
pub fn run_emulated(out_dir: Option<&Path>) -> Report {
    let mut rep = Report::default();
    let emu = match crate::emu::Emulator::build(None) {
        Ok(e) => e,
        Err(e) => {
            rep.kernels_error = Some(e.to_string());
            if let Some(d) = out_dir {
                write(d, &rep);
            }
            return rep;
        }
    };
    rep.emulated = Some(format!(
        "CPU emulation (crates/envelope-cuda/emu), {} in {}",
        emu.compiler,
        emu.dir.display()
    ));
    rep.kernels = rep.emulated.clone();
    rep.compile = emu
        .built
        .iter()
        .map(|b| CompileResult {
            file: b.file.into(),
            seconds: b.seconds,
            ptx_bytes: 0,
            from_cache: b.from_cache,
            error: b.error.clone(),
        })
        .collect();
    let gpu = Gpu::Emu(emu);
    rep.cases = run_cases(&gpu);
    rep.passed = rep.cases.iter().filter(|c| c.passed).count();
    rep.failed = rep.cases.len() - rep.passed;
    if let Some(d) = out_dir {
        write(d, &rep);
    }
    rep
}

/// Every case group, each failure recorded (a panic too), none fatal.
fn run_cases(gpu: &Gpu) -> Vec<CaseResult> {
    let mut cx = Cx {
        gpu,
        rng: Rng::new(0x5EED_0007),
        out: Vec::new(),
    };
    type CaseFn = fn(&mut Cx);
    let groups: [(&str, CaseFn); 5] = [
        ("elementwise", elementwise_cases),
        ("gemm", gemm_cases),
        ("model support", model_support_cases),
        ("attention", attention_cases),
        ("sampling", sampling_cases),
    ];
    for (name, f) in groups {
        if let Err(e) = guarded("self-test cases", || f(&mut cx)) {
            cx.out.push(CaseResult {
                case: format!("{name} (aborted)"),
                entry: String::new(),
                dtype: Dt::F32,
                tolerance: tolerance(Dt::F32),
                elements: 0,
                max_abs_err: f32::NAN,
                max_err_over_tol: f32::NAN,
                passed: false,
                note: None,
                error: Some(e.to_string()),
            });
        }
    }
    cx.out
}

pub use crate::embedded::version_warning;

fn write(out_dir: &Path, rep: &Report) {
    let _ = std::fs::create_dir_all(out_dir);
    if let Ok(text) = serde_json::to_string_pretty(rep) {
        let _ = std::fs::write(out_dir.join("selftest.json"), text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warns_when_nvrtc_is_newer_than_the_driver() {
        assert!(version_warning((13, 0), "13.0").is_none());
        assert!(version_warning((12, 8), "13.0").is_none());
        assert!(version_warning((13, 1), "13.0").unwrap().contains("newer"));
    }

    #[test]
    fn dtype_bytes_round_trip_and_round() {
        let x = [1.0f32, -2.5, 0.1, 3.0e4];
        for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
            assert_eq!(from_bytes(dt, &to_bytes(dt, &x)), round(dt, &x));
        }
        assert_eq!(round(Dt::Bf16, &[0.1])[0], bf16::from_f32(0.1).to_f32());
        assert_eq!(to_bytes(Dt::Bf16, &x).len(), 8);
    }

    #[test]
    fn compare_uses_the_stated_tolerance() {
        let t = Tol {
            atol: 0.1,
            rtol: 0.0,
        };
        let (abs, ratio, i) = compare(&[1.0, 2.05, 3.0], &[1.0, 2.0, 3.0], t);
        assert!((abs - 0.05).abs() < 1e-6 && ratio < 1.0 && i == 1);
        assert!(compare(&[1.0, 2.5], &[1.0, 2.0], t).1 > 1.0);
        assert!(compare(&[f32::NAN], &[1.0], t).1.is_infinite());
        let exact = Tol {
            atol: 0.0,
            rtol: 0.0,
        };
        assert_eq!(compare(&[5.0, 49_151.0], &[5.0, 49_151.0], exact).1, 0.0);
        assert!(compare(&[5.0, 49_150.0], &[5.0, 49_151.0], exact)
            .1
            .is_infinite());
        assert!(compare(&[1.0], &[1.0, 2.0], t).1.is_infinite());
    }

    #[test]
    fn rounding_the_reference_output_stays_inside_the_tolerance() {
        // One output rounding (what the GPU adds over the f32 reference)
        // must fit each dtype's tolerance, or the self-test could never pass.
        let mut rng = Rng::new(3);
        let x = rng.vec(10_000, 100.0);
        for dt in [Dt::F16, Dt::Bf16] {
            let (_, ratio, _) = compare(&round(dt, &x), &x, tolerance(dt));
            assert!(ratio <= 1.0, "{dt:?} {ratio}");
        }
    }

    #[test]
    fn random_blocks_are_well_formed() {
        let mut rng = Rng::new(1);
        for (fmt, bytes) in [("q4_0", 18), ("q4_1", 20), ("q8_0", 34)] {
            let b = random_q_blocks(&mut rng, fmt, 10);
            assert_eq!(b.len(), 10 * bytes);
            let w = match fmt {
                "q4_0" => r::dequant_q4_0(&b),
                "q4_1" => r::dequant_q4_1(&b),
                _ => r::dequant_q8_0(&b),
            };
            assert!(w.iter().all(|v| v.is_finite()) && w.len() == 320);
        }
        let p = rng.perm(50);
        let mut s = p.clone();
        s.sort();
        assert_eq!(s, (0..50).collect::<Vec<u32>>());
    }

    /// The whole self-test on this machine: without a driver it writes a
    /// report that says why, and does not panic.
    #[test]
    fn without_a_gpu_the_report_says_why() {
        let dir = std::env::temp_dir().join(format!("envelope-selftest-{}", std::process::id()));
        let rep = run(0, &dir, serde_json::json!({}));
        let text = std::fs::read_to_string(dir.join("selftest.json")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        if rep.device.is_none() {
            assert!(!rep.ok());
            assert!(text.contains("libcuda.so"), "{text}");
        }
    }
}
