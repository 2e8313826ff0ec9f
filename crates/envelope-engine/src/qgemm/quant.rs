//! One block of activations to 8 bits: `amax / 127` is the scale, every
//! value is `round(x / scale)` (half away from zero, as `f32::round`) and
//! the i8 sum comes with it. The AVX2 path gives the same bytes as
//! [`block_scalar`] for every input, NaN and infinities included: a
//! 16-sequence decode step spent 11% of its time in the scalar loop
//! (one convert and one byte insert per value).

use super::QK;

/// The block's i8 values, its scale (before f16 rounding) and their sum.
pub type Quantised = ([i8; QK], f32, i32);

/// The scale and its inverse (0 for a block of zeros).
#[inline(always)]
fn scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// The reference: one value at a time.
pub fn block_scalar(xs: &[f32]) -> Quantised {
    let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
    let (d, id) = scale(amax);
    let mut sum = 0i32;
    let mut qs = [0i8; QK];
    for (q, v) in qs.iter_mut().zip(xs) {
        *q = (v * id).round() as i8;
        sum += *q as i32;
    }
    (qs, d, sum)
}

/// The fastest path this build has.
#[inline]
pub fn block(xs: &[f32]) -> Quantised {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if xs.len() == QK {
        // SAFETY: AVX2 is enabled at compile time; `xs` holds QK = 32
        // values, the four 8-lane loads.
        return unsafe { block_avx2(xs) };
    }
    block_scalar(xs)
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
unsafe fn block_avx2(xs: &[f32]) -> Quantised {
    use std::arch::x86_64::*;
    let p = xs.as_ptr();
    let v = [
        _mm256_loadu_ps(p),
        _mm256_loadu_ps(p.add(8)),
        _mm256_loadu_ps(p.add(16)),
        _mm256_loadu_ps(p.add(24)),
    ];
    let sign = _mm256_set1_ps(-0.0);
    // amax: `maxps` returns its second operand when either is NaN, so a
    // NaN value leaves the running maximum as `f32::max` does.
    let mut m = _mm256_setzero_ps();
    for x in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, x), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
    let (d, id) = scale(_mm_cvtss_f32(m1));
    let id = _mm256_set1_ps(id);
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let mut ints = [_mm256_setzero_si256(); 4];
    for (q, x) in ints.iter_mut().zip(v) {
        let y = _mm256_mul_ps(x, id);
        // Half away from zero: truncate, then step one away from zero
        // where the dropped fraction (exact) is at least a half.
        let t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(y, t));
        let away = _mm256_or_ps(_mm256_and_ps(y, sign), one);
        let step = _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), away);
        let r = _mm256_add_ps(t, step);
        // `as i8`: saturating (infinities), NaN to 0.
        let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        let r = _mm256_and_ps(r, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
        *q = _mm256_cvttps_epi32(r);
    }
    let s = _mm256_add_epi32(
        _mm256_add_epi32(ints[0], ints[1]),
        _mm256_add_epi32(ints[2], ints[3]),
    );
    let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    // i32 -> i16 -> i8 packs work inside 128-bit lanes; a final
    // permutation puts the four-value runs back in order.
    let w01 = _mm256_packs_epi32(ints[0], ints[1]);
    let w23 = _mm256_packs_epi32(ints[2], ints[3]);
    let b = _mm256_packs_epi16(w01, w23);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut qs = [0i8; QK];
    _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, b);
    (qs, d, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same(xs: &[f32]) {
        let (a, b) = (block(xs), block_scalar(xs));
        assert_eq!(a.0, b.0, "values of {xs:?}");
        assert_eq!(a.1.to_bits(), b.1.to_bits(), "scale of {xs:?}");
        assert_eq!(a.2, b.2, "sum of {xs:?}");
    }

    #[test]
    fn the_vector_block_is_the_scalar_one_on_every_input() {
        // Random blocks over many magnitudes.
        let mut s = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..20_000 {
            let e = (next() % 40) as i32 - 20;
            let xs: Vec<f32> = (0..QK)
                .map(|_| ((next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 2f32.powi(e))
                .collect();
            same(&xs);
        }
        // Exact halves: amax 127 makes the scale 1, so x.5 must round away
        // from zero (a nearest-even rounding gives 2 for 2.5).
        let mut xs: Vec<f32> = (0..QK).map(|i| i as f32 - 15.5).collect();
        xs[0] = 127.0;
        same(&xs);
        xs[1] = -127.0;
        xs[2] = 2.5;
        xs[3] = -2.5;
        xs[4] = 0.5;
        xs[5] = -0.5;
        xs[6] = -0.0;
        same(&xs);
        // Zeros, NaN, infinities, subnormals.
        same(&[0.0; QK]);
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, f32::MAX] {
            let mut xs = vec![0.25f32; QK];
            xs[7] = special;
            xs[20] = -0.75;
            same(&xs);
            same(&[special; QK]);
        }
    }
}
