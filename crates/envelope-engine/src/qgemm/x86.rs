//! The x86 kernels: one weight row against one activation tile of `R`
//! rows, `R` known at compile time so the row loop unrolls into registers.
//! Written once ([`tile_kernels`]) and compiled twice: with AVX2's
//! `maddubs` + `madd` and with AVX-512 VNNI's `vpdpbusd`.

use super::groups::{qs_at, GROUP};
use super::{f16_at, QFormat, Tile, QK, ROWS};
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// 16 packed nibbles -> 32 u8 in element order (low nibbles are 0..16).
#[inline(always)]
unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
    let v = _mm_loadu_si128(p as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    _mm256_set_m128i(hi, lo)
}

/// `u` (u8) x `s` (i8), summed in fours into eight i32 lanes: `maddubs`
/// (pairs into saturating i16; 4-bit or sign-folded 8-bit operands never
/// saturate) then `madd` with ones.
#[inline(always)]
unsafe fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// The same sums in one VNNI instruction.
#[inline(always)]
unsafe fn dot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

macro_rules! tile_kernels {
    ($entry:ident, $features:literal, $dot:ident, $even:ident) => {
        /// Each weight row of `rows` (`rb` bytes apiece, one after
        /// another) against every row of `t`, into `res` (one per weight
        /// row): one call for a task's rows, so decode pays one dispatch
        /// on the tile height per task, not per row.
        ///
        /// # Safety
        /// The CPU has the features enabled here; each row is whole blocks
        /// of `f` matching `t`'s blocks per row.
        #[target_feature(enable = $features)]
        pub unsafe fn $entry(
            f: QFormat,
            rows: &[u8],
            rb: usize,
            t: &Tile,
            res: &mut [[f32; ROWS]],
        ) {
            #[target_feature(enable = $features)]
            unsafe fn kernel<const R: usize>(
                f: QFormat,
                row: &[u8],
                t: &Tile,
                res: &mut [f32; ROWS],
            ) {
                let bb = f.block_bytes();
                let nb = row.len() / bb;
                debug_assert!(t.qs.len() >= nb * R && t.h == R);
                let base = row.as_ptr();
                let qs = t.qs.as_ptr() as *const u8;
                let ad = t.d.as_ptr();
                // Q4_1's min multiplies s; Q4_0's -8 offset multiplies ds.
                let asum = if f == QFormat::Q4_1 {
                    t.s.as_ptr()
                } else {
                    t.ds.as_ptr()
                };
                let mut acc = [_mm256_setzero_ps(); R];
                let mut extra = [0f32; R];
                let mut extra8 = _mm256_setzero_ps();
                // Blocks in order into one accumulator per row, as ggml and
                // candle sum them. Measured, not adopted: summing even and
                // odd blocks apart (two FMA chains) drifts further from
                // their rounding (tests/reference_logits), and interleaving
                // two or four weight rows ran slower on the 2-core EPYC.
                // One loop per format, so no block tests the format.
                macro_rules! q4_blocks {
                    ($q41:expr) => {
                        for b in 0..nb {
                            let blk = base.add(b * bb);
                            let d = f16_at(std::slice::from_raw_parts(blk, 2), 0);
                            let dv = _mm256_set1_ps(d);
                            let a0 = b * R;
                            let (w, m) = if $q41 {
                                (
                                    unpack_nibbles(blk.add(4)),
                                    f16_at(std::slice::from_raw_parts(blk.add(2), 2), 0),
                                )
                            } else {
                                (unpack_nibbles(blk.add(2)), -8.0 * d)
                            };
                            for ri in 0..R {
                                let av =
                                    _mm256_loadu_si256(qs.add((a0 + ri) * QK) as *const __m256i);
                                let p = _mm256_cvtepi32_ps($dot(w, av));
                                let sc = _mm256_mul_ps(dv, _mm256_set1_ps(*ad.add(a0 + ri)));
                                acc[ri] = _mm256_fmadd_ps(p, sc, acc[ri]);
                            }
                            if R == 8 {
                                // Multiply, then add (not fused): the
                                // rounding of the other tile heights.
                                let sv = _mm256_loadu_ps(asum.add(a0));
                                extra8 =
                                    _mm256_add_ps(extra8, _mm256_mul_ps(_mm256_set1_ps(m), sv));
                            } else {
                                for ri in 0..R {
                                    extra[ri] += m * *asum.add(a0 + ri);
                                }
                            }
                        }
                    };
                }
                match f {
                    QFormat::Q4_1 => q4_blocks!(true),
                    QFormat::Q4_0 => q4_blocks!(false),
                    QFormat::Q8_0 => {
                        for b in 0..nb {
                            let blk = base.add(b * bb);
                            let dv = _mm256_set1_ps(f16_at(std::slice::from_raw_parts(blk, 2), 0));
                            let a0 = b * R;
                            let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                            let aw = _mm256_sign_epi8(w, w); // |w| as u8
                            for ri in 0..R {
                                let av =
                                    _mm256_loadu_si256(qs.add((a0 + ri) * QK) as *const __m256i);
                                let sa = _mm256_sign_epi8(av, w); // a with w's sign
                                let p = _mm256_cvtepi32_ps($dot(aw, sa));
                                let sc = _mm256_mul_ps(dv, _mm256_set1_ps(*ad.add(a0 + ri)));
                                acc[ri] = _mm256_fmadd_ps(p, sc, acc[ri]);
                            }
                        }
                    }
                }
                let mut e8 = [0f32; 8];
                _mm256_storeu_ps(e8.as_mut_ptr(), extra8);
                for ri in 0..R {
                    let e = if R == 8 { e8[ri] } else { extra[ri] };
                    res[ri] = hsum(acc[ri]) + e;
                }
            }
            debug_assert!(ROWS == 8);
            macro_rules! each_row {
                ($k:expr) => {
                    for (row, r) in rows.chunks_exact(rb).zip(res.iter_mut()) {
                        $k(f, row, t, r)
                    }
                };
            }
            // Even heights may take a kernel that pairs rows (`$even`).
            match t.h {
                1 => each_row!(kernel::<1>),
                2 => each_row!($even::<2>),
                3 => each_row!(kernel::<3>),
                4 => each_row!($even::<4>),
                5 => each_row!(kernel::<5>),
                6 => each_row!($even::<6>),
                7 => each_row!(kernel::<7>),
                _ => each_row!($even::<8>),
            }
        }
    };
}

tile_kernels!(dot_tile_avx2, "avx2,fma", dot_avx2, kernel);
tile_kernels!(
    dot_tile_vnni,
    "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni",
    dot_vnni,
    pairs512
);

/// The VNNI kernel for an even number of rows: two activation rows share
/// one 512-bit vector (their blocks sit side by side in the tile), against
/// the weight block repeated in both halves. Each half does exactly what
/// [`dot_tile_vnni`]'s 256-bit kernel does for its row (the same integer
/// sums, scale product and FMA, in the same block order), so results are
/// bit for bit the same; the work per row and block halves where the CPU
/// runs 512-bit vectors at full width.
// Indexed loops over rows and pairs read as the lanes they fill.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn pairs512<const R: usize>(f: QFormat, row: &[u8], t: &Tile, res: &mut [f32; ROWS]) {
    debug_assert!(R.is_multiple_of(2) && t.h == R);
    let bb = f.block_bytes();
    let nb = row.len() / bb;
    let base = row.as_ptr();
    let qs = t.qs.as_ptr() as *const u8;
    let asum = if f == QFormat::Q4_1 {
        t.s.as_ptr()
    } else {
        t.ds.as_ptr()
    };
    // Lanes 0-7 take the first row's scale, 8-15 the second's.
    let ad8 = t.d8.as_ptr() as *const f32;
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut extra = [0f32; R];
    let mut extra8 = _mm256_setzero_ps();
    // One loop per format (the format a constant in each), so no block
    // tests the format and Q4 blocks skip Q8_0's sign move.
    macro_rules! blocks {
        ($f:expr) => {
            for b in 0..nb {
                let blk = base.add(b * bb);
                let d = f16_at(std::slice::from_raw_parts(blk, 2), 0);
                let dv = _mm512_set1_ps(d);
                let a0 = b * R;
                // The block's u8 operand in both halves, and for Q8_0 the
                // sign to move onto the activations (AVX-512 has no vpsignb).
                let (w, neg, m) = match $f {
                    QFormat::Q4_1 => (
                        unpack_nibbles(blk.add(4)),
                        0,
                        f16_at(std::slice::from_raw_parts(blk.add(2), 2), 0),
                    ),
                    QFormat::Q4_0 => (unpack_nibbles(blk.add(2)), 0, -8.0 * d),
                    QFormat::Q8_0 => {
                        let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                        (
                            _mm256_sign_epi8(w, w),
                            _mm512_movepi8_mask(_mm512_broadcast_i64x4(w)),
                            0.0,
                        )
                    }
                };
                let w = _mm512_broadcast_i64x4(w);
                for p in 0..R / 2 {
                    let at = a0 + 2 * p;
                    let av = _mm512_loadu_si512(qs.add(at * QK) as *const _);
                    // Q8_0: a with w's sign (w = 0 multiplies |w| = 0 either way).
                    let av = if $f == QFormat::Q8_0 {
                        _mm512_mask_sub_epi8(av, neg, zero, av)
                    } else {
                        av
                    };
                    let pf = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, w, av));
                    let a_d = _mm512_loadu_ps(ad8.add(at * 8));
                    acc[p] = _mm512_fmadd_ps(pf, _mm512_mul_ps(dv, a_d), acc[p]);
                }
                if $f != QFormat::Q8_0 {
                    if R == 8 {
                        // Multiply, then add (not fused), as the other kernels.
                        let sv = _mm256_loadu_ps(asum.add(a0));
                        extra8 = _mm256_add_ps(extra8, _mm256_mul_ps(_mm256_set1_ps(m), sv));
                    } else {
                        for ri in 0..R {
                            extra[ri] += m * *asum.add(a0 + ri);
                        }
                    }
                }
            }
        };
    }
    match f {
        QFormat::Q4_1 => blocks!(QFormat::Q4_1),
        QFormat::Q4_0 => blocks!(QFormat::Q4_0),
        QFormat::Q8_0 => blocks!(QFormat::Q8_0),
    }
    let mut e8 = [0f32; 8];
    _mm256_storeu_ps(e8.as_mut_ptr(), extra8);
    for p in 0..R / 2 {
        let lo = _mm512_castps512_ps256(acc[p]);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p]), 1));
        for (ri, half) in [(2 * p, lo), (2 * p + 1, hi)] {
            let e = if R == 8 { e8[ri] } else { extra[ri] };
            res[ri] = hsum(half) + e;
        }
    }
}

/// Groups of 16 weight rows (see [`super::groups`]; `gb` bytes apiece,
/// one after another) against every row of `t`: group `i`'s 16 results
/// for row `ri` go to `out[ri * stride + 16 i ..][..16]`. One call for a
/// task's groups, so the dispatch on the tile height and format is paid
/// once. Each lane does what [`super::dot_rows_scalar`] does for its
/// (weight row, activation row): the block's integer dot (exact in any
/// order), times the weight scale, times the activation scale, added; then
/// Q4_1's minimum (Q4_0's -8 offset) times the activations' sum, added. So
/// the results are bit for bit the scalar reference's, whatever the tile
/// height.
///
/// # Safety
/// The CPU has the features enabled here; `groups` is whole group blocks
/// of `f` matching `t`'s blocks per row; `out` has room for `t.h` rows of
/// `16 x groups` at `stride`.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
pub unsafe fn group_tile_vnni(
    f: QFormat,
    groups: &[u8],
    gb: usize,
    t: &Tile,
    out: *mut f32,
    stride: usize,
) {
    macro_rules! each_group {
        ($r:literal, $f:literal) => {
            for (i, g) in groups.chunks_exact(gb).enumerate() {
                group_kernel::<$r, $f>(g, t, out.add(i * GROUP), stride)
            }
        };
    }
    macro_rules! heights {
        ($f:literal) => {
            match t.h {
                1 => each_group!(1, $f),
                2 => each_group!(2, $f),
                3 => each_group!(3, $f),
                4 => each_group!(4, $f),
                5 => each_group!(5, $f),
                6 => each_group!(6, $f),
                7 => each_group!(7, $f),
                _ => each_group!(8, $f),
            }
        };
    }
    debug_assert!(ROWS == 8 && (1..=ROWS).contains(&t.h));
    match f {
        QFormat::Q4_0 => heights!(0),
        QFormat::Q4_1 => heights!(1),
        QFormat::Q8_0 => heights!(2),
    }
}

/// [`group_tile_vnni`] for `R` activation rows and format `F` (0: Q4_0,
/// 1: Q4_1, 2: Q8_0), both constants, so the loops unroll into registers.
// Indexed loops over chunks and rows read as the lanes they fill.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn group_kernel<const R: usize, const F: u8>(
    group: &[u8],
    t: &Tile,
    out: *mut f32,
    stride: usize,
) {
    let f = match F {
        0 => QFormat::Q4_0,
        1 => QFormat::Q4_1,
        _ => QFormat::Q8_0,
    };
    let gb = GROUP * f.block_bytes();
    let nb = group.len() / gb;
    debug_assert!(t.h == R && t.qs.len() >= nb * R);
    let base = group.as_ptr();
    // A row's block as 8 little-endian i32s: four activation bytes each.
    let qs = t.qs.as_ptr() as *const i32;
    let ad = t.d.as_ptr();
    let asum = if F == 1 { t.s.as_ptr() } else { t.ds.as_ptr() };
    let off8 = t.off8.as_ptr();
    let at_qs = qs_at(f);
    let low = _mm512_set1_epi8(0x0F);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let blk = base.add(b * gb);
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let a0 = b * R;
        // The block's 32 weight bytes of 16 rows, as 8 operands of four
        // bytes a lane, matching activation words 0..8.
        let mut w = [zero; 8];
        if F == 2 {
            for c in 0..8 {
                w[c] = _mm512_loadu_si512(blk.add(at_qs + 64 * c) as *const _);
            }
        } else {
            for c in 0..4 {
                let q = _mm512_loadu_si512(blk.add(at_qs + 64 * c) as *const _);
                w[c] = _mm512_and_si512(q, low);
                w[4 + c] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
            }
        }
        let m = match F {
            1 => _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i)),
            0 => _mm512_mul_ps(dw, _mm512_set1_ps(-8.0)),
            _ => _mm512_setzero_ps(),
        };
        for r in 0..R {
            let a = qs.add((a0 + r) * 8);
            // Two chains of four, summed: integer sums are exact in any
            // order. Q8_0's weights went in as w + 128: one chain starts
            // from -128 x the activations' sum.
            let mut s0 = if F == 2 {
                _mm512_set1_epi32(*off8.add(a0 + r))
            } else {
                zero
            };
            let mut s1 = zero;
            for c in 0..4 {
                s0 = _mm512_dpbusd_epi32(s0, w[c], _mm512_set1_epi32(a.add(c).read_unaligned()));
                s1 = _mm512_dpbusd_epi32(
                    s1,
                    w[4 + c],
                    _mm512_set1_epi32(a.add(4 + c).read_unaligned()),
                );
            }
            let sumi = _mm512_add_epi32(s0, s1);
            let p = _mm512_mul_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dw),
                _mm512_set1_ps(*ad.add(a0 + r)),
            );
            acc[r] = _mm512_add_ps(acc[r], p);
            if F != 2 {
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(m, _mm512_set1_ps(*asum.add(a0 + r))));
            }
        }
    }
    for r in 0..R {
        _mm512_storeu_ps(out.add(r * stride), acc[r]);
    }
}
