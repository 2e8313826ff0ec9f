//! fp8 e4m3 (the `e4m3fn` variant cuBLASLt and vLLM use: no infinities,
//! largest finite 448, NaN = S.1111.111) and the scales that map a tensor
//! into it: `scale = amax / 448`, per tensor or per output channel, so
//! `w ~= decode(encode(w / scale)) * scale`. Encoding rounds to nearest,
//! ties to even, and saturates (CUDA's `__NV_SATFINITE`). The host-side
//! reference for the fp8 weight path (compute capability 8.9+).

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Relative error bound of one rounding for normal values: half of the
/// 2^-3 spacing of a 3-bit mantissa.
pub const E4M3_REL_ERR: f32 = 1.0 / 16.0;
/// Absolute error bound in the subnormal range: half the 2^-9 step.
pub const E4M3_SUBNORMAL_ABS_ERR: f32 = 1.0 / 1024.0;

/// fp8 tensor-core GEMMs (cuBLASLt e4m3) need compute capability 8.9 (Ada)
/// or later; bf16 -> fp8 is gated on this.
pub fn fp8_supported(compute_capability: (i32, i32)) -> bool {
    compute_capability >= (8, 9)
}

/// e4m3 bits to f32.
pub fn decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as f32;
    if e == 15 && b & 0x07 == 7 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * v
}

/// f32 to e4m3 bits: round to nearest even, saturate to +-448, NaN to 0x7F.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    let code = if a >= E4M3_MAX {
        0x7E
    } else if a < 2f32.powi(-6) {
        // Subnormals step by 2^-9; q = 8 is the smallest normal, whose code is also 8.
        (a * 512.0).round_ties_even() as u8
    } else {
        let mut e = ((a.to_bits() >> 23) & 0xFF) as i32 - 127;
        let mut q = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
        if q == 8 {
            e += 1;
            q = 0;
        }
        (((e + 7) << 3) | q).min(0x7E) as u8
    };
    sign | code
}

/// `amax / 448`; 1 for an all-zero tensor (any scale represents it).
pub fn scale_for(values: &[f32]) -> f32 {
    let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// One scale for the whole tensor.
pub fn per_tensor_scale(w: &[f32]) -> f32 {
    scale_for(w)
}

/// One scale per output channel of a row-major `[rows, cols]` weight.
pub fn per_channel_scales(w: &[f32], cols: usize) -> Vec<f32> {
    w.chunks(cols).map(scale_for).collect()
}

pub fn quantize(w: &[f32], scale: f32) -> Vec<u8> {
    w.iter().map(|&x| encode(x / scale)).collect()
}

pub fn dequantize(q: &[u8], scale: f32) -> Vec<f32> {
    q.iter().map(|&b| decode(b) * scale).collect()
}

/// The error bound of one value after quantise + dequantise with `scale`.
pub fn round_trip_bound(x: f32, scale: f32) -> f32 {
    (x.abs() * E4M3_REL_ERR).max(scale * E4M3_SUBNORMAL_ABS_ERR) * 1.0001
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_needs_ada_or_later() {
        assert!(!fp8_supported((8, 0)));
        assert!(!fp8_supported((8, 6)));
        assert!(fp8_supported((8, 9)));
        assert!(fp8_supported((9, 0)));
        assert!(fp8_supported((10, 0)));
    }

    #[test]
    fn known_codes() {
        assert_eq!(decode(0x7E), 448.0);
        assert!(decode(0x7F).is_nan());
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x08), 2f32.powi(-6));
        assert_eq!(encode(1.0), 0x38);
        assert_eq!(encode(-1.0), 0xB8);
        assert_eq!(encode(448.0), 0x7E);
        assert_eq!(encode(1e6), 0x7E);
        assert_eq!(encode(-1e6), 0xFE);
        assert_eq!(encode(f32::NAN), 0x7F);
        assert_eq!(encode(0.0), 0x00);
    }

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0u8..=255 {
            let v = decode(b);
            if v.is_nan() {
                continue;
            }
            let back = encode(v);
            assert_eq!(decode(back), v, "code {b:#04x}");
        }
    }

    #[test]
    fn ties_go_to_even_mantissas() {
        assert_eq!(decode(encode(1.0625)), 1.0); // between m=0 and m=1
        assert_eq!(decode(encode(1.1875)), 1.25); // between m=1 and m=2
        assert_eq!(decode(encode(1.5 * 2f32.powi(-9))), 2.0 * 2f32.powi(-9));
        // Just below the smallest normal rounds up into it.
        assert_eq!(encode(2f32.powi(-6) - 2f32.powi(-12)), 0x08);
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn per_tensor_round_trip_within_bounds() {
        let mut s = 7;
        let w: Vec<f32> = (0..4096).map(|_| lcg(&mut s) * 0.05).collect();
        let scale = per_tensor_scale(&w);
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!((scale * 448.0 - amax).abs() <= amax * 1e-6);
        let back = dequantize(&quantize(&w, scale), scale);
        for (x, y) in w.iter().zip(&back) {
            assert!((x - y).abs() <= round_trip_bound(*x, scale), "{x} -> {y}");
        }
        // The largest magnitude maps to 448 (within one f32 rounding of the division).
        let i = w.iter().position(|v| v.abs() == amax).unwrap();
        assert!((back[i].abs() - amax).abs() <= amax * E4M3_REL_ERR);
    }

    #[test]
    fn per_channel_scales_follow_each_row() {
        let mut s = 11;
        let (rows, cols) = (4, 256);
        // Rows of very different magnitude: per-channel keeps small rows precise.
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| lcg(&mut s) * 10f32.powi(-((i / cols) as i32)))
            .collect();
        let scales = per_channel_scales(&w, cols);
        assert_eq!(scales.len(), rows);
        let t = per_tensor_scale(&w);
        let (mut err_c, mut err_t) = (0f32, 0f32);
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            let back = dequantize(&quantize(row, scales[r]), scales[r]);
            for (x, y) in row.iter().zip(&back) {
                assert!((x - y).abs() <= round_trip_bound(*x, scales[r]));
                err_c = err_c.max((x - y).abs() / (scales[r] * 448.0));
            }
            let back_t = dequantize(&quantize(row, t), t);
            for (x, y) in row.iter().zip(&back_t) {
                err_t = err_t.max((x - y).abs() / (scales[r] * 448.0));
            }
        }
        assert!(err_c < err_t, "per-channel {err_c} vs per-tensor {err_t}");
        assert_eq!(per_tensor_scale(&[0.0; 8]), 1.0);
    }
}
