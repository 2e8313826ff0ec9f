//! Quantised matrix multiply for GGUF block formats (Q4_0, Q4_1, Q8_0), ours
//! rather than candle's: candle 0.11 has no SIMD path for Q4_1 (the format of
//! the development model), and none of its kernels reuse a weight block
//! across the rows of a batch. Activations are quantised to 8 bits per block
//! of 32 (scale rounded to f16, as ggml's Q8_0/Q8_1 do), each weight block is
//! unpacked once and dotted with up to `ROWS` activation rows (AVX2
//! `maddubs`/`madd`, the approach of ggml's `vec_dot_q4_1_q8_1`), and output
//! rows are split across threads.

use half::f16;
use rayon::prelude::*;

pub const QK: usize = 32;
/// Activation rows sharing one unpacked weight block.
const ROWS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QFormat {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl QFormat {
    pub fn block_bytes(self) -> usize {
        match self {
            QFormat::Q4_0 => 18,
            QFormat::Q4_1 => 20,
            QFormat::Q8_0 => 34,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QFormat::Q4_0 => "q4_0",
            QFormat::Q4_1 => "q4_1",
            QFormat::Q8_0 => "q8_0",
        }
    }
}

/// A `[n, k]` matrix of ggml blocks, row-major, bytes exactly as in GGUF.
pub struct QMatrix {
    pub format: QFormat,
    pub n: usize,
    pub k: usize,
    pub data: Vec<u8>,
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

impl QMatrix {
    pub fn new(format: QFormat, n: usize, k: usize, data: Vec<u8>) -> Option<QMatrix> {
        (k.is_multiple_of(QK) && data.len() == n * k / QK * format.block_bytes())
            .then_some(QMatrix { format, n, k, data })
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row(&self, j: usize) -> &[u8] {
        let rb = self.k / QK * self.format.block_bytes();
        &self.data[j * rb..(j + 1) * rb]
    }

    /// Row `j` as f32 (the embedding lookup).
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let bb = self.format.block_bytes();
        for (b, blk) in self.row(j).chunks_exact(bb).enumerate() {
            let o = &mut out[b * QK..(b + 1) * QK];
            match self.format {
                QFormat::Q4_0 | QFormat::Q4_1 => {
                    let d = f16_at(blk, 0);
                    let (m, qs) = if self.format == QFormat::Q4_1 {
                        (f16_at(blk, 2), &blk[4..20])
                    } else {
                        (-8.0 * d, &blk[2..18])
                    };
                    for i in 0..16 {
                        o[i] = (qs[i] & 0x0F) as f32 * d + m;
                        o[i + 16] = (qs[i] >> 4) as f32 * d + m;
                    }
                }
                QFormat::Q8_0 => {
                    let d = f16_at(blk, 0);
                    for i in 0..32 {
                        o[i] = blk[2 + i] as i8 as f32 * d;
                    }
                }
            }
        }
    }
}

/// One block of 32 activations quantised to i8.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub struct ActBlock {
    /// Scale (f16-rounded).
    d: f32,
    /// d x sum(qs), rounded like ggml's Q8_1 `s` (for Q4_1's min term).
    s: f32,
    /// d x sum(qs), exact (for Q4_0's -8 offset).
    ds: f32,
    qs: [i8; QK],
}

/// Quantises `m` rows of `k` activations.
pub fn quantize_rows(x: &[f32], k: usize) -> Vec<ActBlock> {
    let nb = k / QK;
    let mut out = vec![
        ActBlock {
            d: 0.0,
            s: 0.0,
            ds: 0.0,
            qs: [0; QK]
        };
        x.len() / QK
    ];
    let quant = |(xs, ys): (&[f32], &mut ActBlock)| {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in ys.qs.iter_mut().zip(xs) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        let d16 = f16::from_f32(d);
        ys.d = d16.to_f32();
        ys.s = (f16::from_f32(sum as f32) * d16).to_f32();
        ys.ds = sum as f32 * ys.d;
    };
    if x.len() >= 64 * QK {
        x.par_chunks_exact(QK)
            .zip(out.par_iter_mut())
            .for_each(quant);
    } else {
        x.chunks_exact(QK).zip(out.iter_mut()).for_each(quant);
    }
    debug_assert_eq!(out.len() % nb, 0);
    out
}

/// `out[m, n] = x[m, k] . w[n, k]^T`.
pub fn matmul(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    assert_eq!(x.len(), m * k);
    let acts = quantize_rows(x, k);
    let nb = k / QK;
    // Each task fills `out_t[j * m..(j + 1) * m]` for its rows j (transposed),
    // so tasks write disjoint slices.
    let mut out_t = vec![0f32; n * m];
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = (n / (threads * 8)).clamp(8, 256);
    out_t
        .par_chunks_mut(rows_per_task * m)
        .enumerate()
        .for_each(|(t, chunk)| {
            let j0 = t * rows_per_task;
            for (jj, o) in chunk.chunks_mut(m).enumerate() {
                let row = w.row(j0 + jj);
                let mut i = 0;
                while i < m {
                    let r = (m - i).min(ROWS);
                    let mut res = [0f32; ROWS];
                    dot_rows(w.format, row, &acts, nb, i, r, &mut res);
                    o[i..i + r].copy_from_slice(&res[..r]);
                    i += r;
                }
            }
        });
    if m == 1 {
        return out_t;
    }
    let mut out = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = out_t[j * m + i];
        }
    }
    out
}

/// Dots one weight row with activation rows `i0..i0 + r`.
fn dot_rows(
    f: QFormat,
    row: &[u8],
    acts: &[ActBlock],
    nb: usize,
    i0: usize,
    r: usize,
    res: &mut [f32; ROWS],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2() {
            // SAFETY: AVX2 and FMA are present (checked above).
            unsafe { avx2_impl::dot_rows(f, row, acts, nb, i0, r, res) };
            return;
        }
    }
    dot_rows_scalar(f, row, acts, nb, i0, r, res)
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// The portable reference, also the oracle for the SIMD path's tests.
pub fn dot_rows_scalar(
    f: QFormat,
    row: &[u8],
    acts: &[ActBlock],
    nb: usize,
    i0: usize,
    r: usize,
    res: &mut [f32; ROWS],
) {
    let bb = f.block_bytes();
    for (ri, out) in res.iter_mut().enumerate().take(r) {
        let a = &acts[(i0 + ri) * nb..(i0 + ri + 1) * nb];
        let mut acc = 0f32;
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let ab = &a[b];
            let d = f16_at(blk, 0);
            match f {
                QFormat::Q4_0 | QFormat::Q4_1 => {
                    let qs = if f == QFormat::Q4_1 {
                        &blk[4..20]
                    } else {
                        &blk[2..18]
                    };
                    let sumi: i32 = qs
                        .iter()
                        .enumerate()
                        .map(|(j, q)| {
                            (q & 0x0F) as i32 * ab.qs[j] as i32
                                + (q >> 4) as i32 * ab.qs[j + 16] as i32
                        })
                        .sum();
                    acc += sumi as f32 * d * ab.d;
                    acc += if f == QFormat::Q4_1 {
                        f16_at(blk, 2) * ab.s
                    } else {
                        -8.0 * d * ab.ds
                    };
                }
                QFormat::Q8_0 => {
                    let sumi: i32 = (0..32)
                        .map(|j| blk[2 + j] as i8 as i32 * ab.qs[j] as i32)
                        .sum();
                    acc += sumi as f32 * d * ab.d;
                }
            }
        }
        *out = acc;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_impl {
    use super::{f16_at, ActBlock, QFormat, QK, ROWS};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// 16 packed nibbles -> 32 u8 in element order (low nibbles are 0..16).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(v, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_rows(
        f: QFormat,
        row: &[u8],
        acts: &[ActBlock],
        nb: usize,
        i0: usize,
        r: usize,
        res: &mut [f32; ROWS],
    ) {
        let bb = f.block_bytes();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); ROWS];
        let mut extra = [0f32; ROWS];
        let base = row.as_ptr();
        let a_rows: [*const ActBlock; ROWS] =
            std::array::from_fn(|ri| acts.as_ptr().add((i0 + ri.min(r - 1)) * nb));
        for b in 0..nb {
            let blk = base.add(b * bb);
            let d = f16_at(std::slice::from_raw_parts(blk, 2), 0);
            match f {
                QFormat::Q4_0 | QFormat::Q4_1 => {
                    let q41 = f == QFormat::Q4_1;
                    let (qs, m) = if q41 {
                        (
                            blk.add(4),
                            f16_at(std::slice::from_raw_parts(blk.add(2), 2), 0),
                        )
                    } else {
                        (blk.add(2), -8.0 * d)
                    };
                    let w = unpack_nibbles(qs);
                    for ri in 0..r {
                        let a = &*a_rows[ri].add(b);
                        let av = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, av), ones);
                        acc[ri] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(p),
                            _mm256_set1_ps(d * a.d),
                            acc[ri],
                        );
                        extra[ri] += m * if q41 { a.s } else { a.ds };
                    }
                }
                QFormat::Q8_0 => {
                    let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                    let aw = _mm256_sign_epi8(w, w); // |w| as u8
                    for ri in 0..r {
                        let a = &*a_rows[ri].add(b);
                        let av = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                        let sa = _mm256_sign_epi8(av, w); // a with w's sign
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones);
                        acc[ri] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(p),
                            _mm256_set1_ps(d * a.d),
                            acc[ri],
                        );
                    }
                }
            }
        }
        for ri in 0..r {
            res[ri] = hsum(acc[ri]) + extra[ri];
        }
        let _ = QK;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_matrix(f: QFormat, n: usize, k: usize, seed: u64) -> QMatrix {
        let bb = f.block_bytes();
        let mut data = vec![0u8; n * k / QK * bb];
        for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
            let h = crate::weights::splitmix64(seed ^ i as u64);
            let d = f16::from_f32(0.01 + (h % 1000) as f32 * 1e-5)
                .to_bits()
                .to_le_bytes();
            blk[..2].copy_from_slice(&d);
            for (j, b) in blk[2..].iter_mut().enumerate() {
                *b = (crate::weights::splitmix64(h ^ j as u64) & 0xFF) as u8;
            }
            if f == QFormat::Q4_1 {
                blk[2..4].copy_from_slice(&f16::from_f32(-0.05).to_bits().to_le_bytes());
            }
        }
        QMatrix::new(f, n, k, data).unwrap()
    }

    #[test]
    fn simd_matches_scalar_and_dequantised_reference() {
        for f in [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0] {
            let (n, k, m) = (37, 96, 7);
            let w = random_matrix(f, n, k, 5);
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919 % 201) as f32 - 100.0) / 50.0)
                .collect();
            let got = matmul(&w, &x, m);
            // Scalar path on the same quantised activations.
            let acts = quantize_rows(&x, k);
            let mut wr = vec![0f32; k];
            for j in 0..n {
                w.dequantize_row(j, &mut wr);
                for i in 0..m {
                    let mut res = [0f32; ROWS];
                    dot_rows_scalar(f, w.row(j), &acts, k / QK, i, 1, &mut res);
                    let g = got[i * n + j];
                    assert!(
                        (g - res[0]).abs() <= 1e-4 * res[0].abs().max(1.0),
                        "{f:?} simd {g} vs scalar {}",
                        res[0]
                    );
                    // Against f32 weights and f32 activations: only activation rounding differs.
                    let exact: f32 = wr
                        .iter()
                        .zip(&x[i * k..(i + 1) * k])
                        .map(|(a, b)| a * b)
                        .sum();
                    let tol = 0.02
                        * wr.iter()
                            .zip(&x[i * k..(i + 1) * k])
                            .map(|(a, b)| (a * b).abs())
                            .sum::<f32>()
                        + 1e-3;
                    assert!((g - exact).abs() <= tol, "{f:?} {g} vs exact {exact}");
                }
            }
        }
    }

    #[test]
    fn matches_candle_quantized_matmul() {
        use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
        use candle_core::{Device, Module, Tensor};
        // k = 96: candle takes its repacked path (other activation blocks) when k % 256 == 0.
        let (n, k, m) = (64, 96, 5);
        let wf: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7907 % 1009) as f32 - 504.0) / 700.0)
            .collect();
        let xf: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 201) as f32 - 100.0) / 50.0)
            .collect();
        let wt = Tensor::from_vec(wf, (n, k), &Device::Cpu).unwrap();
        let xt = Tensor::from_vec(xf.clone(), (m, k), &Device::Cpu).unwrap();
        for (dt, f) in [
            (GgmlDType::Q4_0, QFormat::Q4_0),
            (GgmlDType::Q4_1, QFormat::Q4_1),
            (GgmlDType::Q8_0, QFormat::Q8_0),
        ] {
            let q = QTensor::quantize(&wt, dt).unwrap();
            let ours = QMatrix::new(f, n, k, q.data().unwrap().into_owned()).unwrap();
            let want: Vec<f32> = QMatMul::from_qtensor(q)
                .unwrap()
                .forward(&xt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got = matmul(&ours, &xf, m);
            for (a, b) in want.iter().zip(&got) {
                assert!(
                    (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                    "{f:?}: candle {a} vs ours {b}"
                );
            }
        }
    }

    #[test]
    fn matrix_size_is_checked() {
        assert!(QMatrix::new(QFormat::Q4_1, 2, 32, vec![0; 40]).is_some());
        assert!(QMatrix::new(QFormat::Q4_1, 2, 32, vec![0; 39]).is_none());
        assert!(QMatrix::new(QFormat::Q8_0, 1, 33, vec![0; 34]).is_none());
    }
}
