//! The MLP's activation, `silu(gate) * up`, on plain slices. candle's
//! `silu` calls libm's scalar `expf` per element; in a 16-sequence decode
//! step that was 3.9% of the samples in `__expf_fma` and 2.9% in candle's
//! map (one thread, while the other waited). Here `e^x` is a polynomial
//! the compiler vectorises; attention's softmax uses it too.

use rayon::prelude::*;

/// `e^x` for any `x`, within about an ulp of libm's: `2^n e^r` with `n =
/// round(x log2 e)`, `|r| <= ln 2 / 2`, and a degree-7 polynomial for
/// `e^r` (its error, `r^8 / 8!`, is below half an ulp). Below -87.3 it
/// returns `e^-87.3` (the smallest normal f32, about), above 88.72 infinity;
/// NaN stays NaN. Written so that a loop of it vectorises.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Comparisons, not `clamp`: a NaN passes through.
    let x = if x < -87.3 { -87.3 } else { x };
    let x = if x > 89.0 { 89.0 } else { x };
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // n as an integer without a float-to-int conversion (whose saturating
    // form does not vectorise well): 1.5 x 2^23 + n holds n in its low
    // mantissa bits. Then 2^n in two halves, each a normal f32 for n in
    // -126..=128 (2^128 overflows to infinity in the product, as e^x does).
    let n = (n + 12_582_912.0).to_bits() as i32 - 0x4B40_0000;
    let half = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    p * pow2(half) * pow2(n - half)
}

/// Elements per parallel task (prefill's activations).
const CHUNK: usize = 16 * 1024;

/// `gate[i] = silu(gate[i]) * up[i]`, `silu(v) = v / (1 + e^-v)`, in
/// candle's order of operations. Long inputs (prefill) are split across
/// threads.
pub fn swiglu_in_place(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    let run = |g: &mut [f32], u: &[f32]| {
        for (g, u) in g.iter_mut().zip(u) {
            *g = *g / (1.0 + exp(-*g)) * u;
        }
    };
    if gate.len() >= 4 * CHUNK {
        gate.par_chunks_mut(CHUNK)
            .zip(up.par_chunks(CHUNK))
            .for_each(|(g, u)| run(g, u));
    } else {
        run(gate, up);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulps_of_libm_and_keeps_its_edges() {
        let mut worst = 0f32;
        for i in 0..=400_000 {
            let x = -87.0 + i as f32 * (175.5 / 400_000.0);
            let (got, want) = (exp(x), x.exp());
            assert!(got.is_finite() && want.is_finite(), "{x}");
            let ulps = (got - want).abs() / (want * f32::EPSILON);
            worst = worst.max(ulps);
        }
        assert!(worst <= 2.0, "worst {worst} ulps");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(1e30), f32::INFINITY);
        assert!(exp(-1e30) > 0.0 && exp(-1e30) < 1.3e-38);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn swiglu_matches_candle_silu_times_up() {
        use candle_core::{Device, Tensor};
        for n in [7, 1536, 4 * CHUNK + 5] {
            let gate: Vec<f32> = (0..n)
                .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 37.0)
                .collect();
            let up: Vec<f32> = (0..n)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 9.0)
                .collect();
            let g = Tensor::new(gate.as_slice(), &Device::Cpu).unwrap();
            let u = Tensor::new(up.as_slice(), &Device::Cpu).unwrap();
            let want: Vec<f32> = (candle_nn::ops::silu(&g).unwrap() * u)
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut got = gate.clone();
            swiglu_in_place(&mut got, &up);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(f32::MIN_POSITIVE),
                    "{i}: gate {} up {}: {a} vs candle {b}",
                    gate[i],
                    up[i]
                );
            }
        }
    }
}
