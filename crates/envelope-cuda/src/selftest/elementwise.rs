//! The layer operations of every dtype, through the runtime's methods:
//! embedding, RMSNorm, RoPE (both layouts), SiLU-mul, the residual add,
//! GGUF dequantisation.

use super::check::{round, Cx};
use crate::reference as r;
use crate::rng::Rng;
use crate::runtime::{le_bytes, DType};
use half::f16;

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

pub(super) fn cases(cx: &mut Cx) {
    for dt in [DType::F32, DType::F16, DType::Bf16] {
        embedding(cx, dt);
        rmsnorm(cx, dt);
        rope(cx, dt);
        silu_mul_and_residual_add(cx, dt);
        dequant(cx, dt);
    }
}

fn embedding(cx: &mut Cx, dt: DType) {
    let (vocab, hidden) = (100, 200);
    let table = round(dt, &cx.rng.vec(vocab * hidden, 1.0));
    let ids: Vec<u32> = (0..7).map(|_| cx.rng.below(vocab) as u32).collect();
    let want = r::embedding(&ids, &table, hidden);
    let entry = format!("embedding_{}", dt.suffix());
    let g = cx.gpu;
    let got = (|| {
        let t = g.upload_f32(dt, &table)?;
        let i = g.upload(DType::U32, &le_bytes(&ids, u32::to_le_bytes))?;
        let o = g.zeros(dt, want.len())?;
        g.embedding(&i, &t, &o, ids.len(), hidden)?;
        g.download(&o)
    })();
    cx.check("embedding 7 of 100x200", &entry, dt, got, &want, None);
}

fn rmsnorm(cx: &mut Cx, dt: DType) {
    for hidden in [576, 4096] {
        let rows = 5;
        let x = round(dt, &cx.rng.vec(rows * hidden, 2.0));
        let w = round(dt, &cx.rng.vec(hidden, 1.0));
        let want = round(dt, &r::rmsnorm(&x, &w, 1e-5));
        let entry = format!("rmsnorm_{}", dt.suffix());
        let g = cx.gpu;
        let got = (|| {
            let (xb, wb) = (g.upload_f32(dt, &x)?, g.upload_f32(dt, &w)?);
            let o = g.zeros(dt, x.len())?;
            g.rmsnorm(&xb, &wb, &o, rows, hidden, 1e-5)?;
            g.download(&o)
        })();
        cx.check(&format!("rmsnorm 5x{hidden}"), &entry, dt, got, &want, None);
    }
}

fn rope(cx: &mut Cx, dt: DType) {
    for (interleaved, theta) in [(false, 10_000.0f32), (true, 500_000.0)] {
        let (heads, hd) = (9, 64);
        let pos: Vec<u32> = vec![0, 1, 5, 100, 1000, 4095];
        let x = round(dt, &cx.rng.vec(pos.len() * heads * hd, 1.0));
        let f = r::inv_freq(theta, hd);
        let mut want = x.clone();
        r::rope(&mut want, &pos, &f, heads, interleaved);
        let want = round(dt, &want);
        let entry = format!("rope_{}", dt.suffix());
        let g = cx.gpu;
        let got = (|| {
            let xb = g.upload_f32(dt, &x)?;
            let pb = g.upload(DType::U32, &le_bytes(&pos, u32::to_le_bytes))?;
            let fb = g.upload_f32_slice(&f)?;
            g.rope(&xb, &pb, &fb, pos.len(), heads, hd, interleaved)?;
            g.download(&xb)
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
}

/// `silu_mul` into its own output; `residual_add` in place (`add_into`,
/// as the model adds a layer's output to the residual stream).
fn silu_mul_and_residual_add(cx: &mut Cx, dt: DType) {
    let n = 10_000;
    let (a, b) = (
        round(dt, &cx.rng.vec(n, 6.0)),
        round(dt, &cx.rng.vec(n, 2.0)),
    );
    let g = cx.gpu;
    let want = round(dt, &r::silu_mul(&a, &b));
    let got = (|| {
        let (ab, bb) = (g.upload_f32(dt, &a)?, g.upload_f32(dt, &b)?);
        let o = g.zeros(dt, n)?;
        g.silu_mul(&ab, &bb, &o, n)?;
        g.download(&o)
    })();
    let entry = format!("silu_mul_{}", dt.suffix());
    cx.check(&format!("silu_mul {n}"), &entry, dt, got, &want, None);

    let want = round(dt, &r::residual_add(&a, &b));
    let got = (|| {
        let (ab, bb) = (g.upload_f32(dt, &a)?, g.upload_f32(dt, &b)?);
        g.add_into(&ab, &bb, n)?;
        g.download(&ab)
    })();
    let entry = format!("residual_add_{}", dt.suffix());
    cx.check(&format!("residual_add {n}"), &entry, dt, got, &want, None);
}

fn dequant(cx: &mut Cx, dt: DType) {
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
        let entry = format!("dequant_{fmt}_{}", dt.suffix());
        let g = cx.gpu;
        let got = (|| {
            let bb = g.upload(DType::U8, &blocks)?;
            let o = g.zeros(dt, nb * 32)?;
            g.dequant(fmt, &bb, &o, nb)?;
            g.download(&o)
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
