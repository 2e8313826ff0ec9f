//! Quantised matrix multiply for GGUF block formats (Q4_0, Q4_1, Q8_0), ours
//! rather than candle's: candle 0.11 has no SIMD path for Q4_1 (the format of
//! the development model), and none of its kernels reuse a weight block
//! across the rows of a batch. Activations are quantised to 8 bits per block
//! of 32 (scale rounded to f16, as ggml's Q8_0/Q8_1 do), each weight block is
//! unpacked once and dotted with up to `ROWS` activation rows (AVX-512
//! VNNI `vpdpbusd` where the CPU has it, else AVX2 `maddubs`/`madd`, the
//! approach of ggml's `vec_dot_q4_1_q8_1`; chosen at run time), and output
//! rows are split across threads. Where the CPU has AVX-512 VNNI, matrices
//! are repacked at load in groups of 16 rows ([`groups`]) and one 512-bit
//! `vpdpbusd` advances 16 output columns: measured on a 2-core EPYC, 1.4x
//! prefill, 1.25x single decode and 1.5x 16-sequence decode over the row
//! kernels (`ENVELOPE_QGEMM_SIMD=vnni-rows` keeps those, for comparisons).

use half::f16;
use rayon::prelude::*;

pub const QK: usize = 32;
/// Activation rows sharing one unpacked weight block.
const ROWS: usize = 8;

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

/// A `[n, k]` matrix of ggml blocks: row-major, bytes exactly as in GGUF,
/// or repacked in groups of rows for the VNNI group kernel
/// ([`QMatrix::for_this_cpu`], [`groups`]).
pub struct QMatrix {
    pub format: QFormat,
    pub n: usize,
    pub k: usize,
    data: Vec<u8>,
    grouped: bool,
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

impl QMatrix {
    pub fn new(format: QFormat, n: usize, k: usize, data: Vec<u8>) -> Option<QMatrix> {
        (k.is_multiple_of(QK) && data.len() == n * k / QK * format.block_bytes()).then_some(
            QMatrix {
                format,
                n,
                k,
                data,
                grouped: false,
            },
        )
    }

    /// The matrix in the layout this CPU's fastest kernel reads: groups of
    /// [`groups::GROUP`] rows where the CPU has AVX-512 VNNI (and `n` is
    /// a multiple of the group), else as it is.
    pub fn for_this_cpu(self) -> QMatrix {
        if simd() == Simd::Vnni && groups_enabled() {
            self.grouped()
        } else {
            self
        }
    }

    /// The matrix in groups of [`groups::GROUP`] rows, when `n` allows.
    pub fn grouped(self) -> QMatrix {
        if self.grouped || !self.n.is_multiple_of(groups::GROUP) {
            return self;
        }
        QMatrix {
            data: groups::pack(self.format, self.n, self.k, &self.data),
            grouped: true,
            ..self
        }
    }

    /// The blocks as GGUF stores them, row after row (for the GPU upload).
    pub fn gguf_bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        if !self.grouped {
            return std::borrow::Cow::Borrowed(&self.data);
        }
        let bb = self.format.block_bytes();
        let nb = self.k / QK;
        let mut out = vec![0u8; self.data.len()];
        for (i, blk) in out.chunks_exact_mut(bb).enumerate() {
            groups::gguf_block(self.format, nb, &self.data, i / nb, i % nb, blk);
        }
        std::borrow::Cow::Owned(out)
    }

    /// Whether the rows are in groups.
    pub fn is_grouped(&self) -> bool {
        self.grouped
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Row `j` as GGUF stores it (row layout only).
    fn row(&self, j: usize) -> &[u8] {
        debug_assert!(!self.grouped);
        let rb = self.row_bytes();
        &self.data[j * rb..(j + 1) * rb]
    }

    /// Bytes of one row (whole blocks).
    fn row_bytes(&self) -> usize {
        self.k / QK * self.format.block_bytes()
    }

    /// Row `j` as f32 (the embedding lookup).
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let bb = self.format.block_bytes();
        let nb = self.k / QK;
        let mut unpacked = [0u8; 34];
        for b in 0..nb {
            let blk = if self.grouped {
                groups::gguf_block(self.format, nb, &self.data, j, b, &mut unpacked);
                &unpacked[..bb]
            } else {
                &self.row(j)[b * bb..(b + 1) * bb]
            };
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

/// Activation rows quantised to i8 per block of 32, laid out for the
/// kernels: rows are grouped in tiles of `ROWS` (the last tile may be
/// shorter), and inside a tile the rows' blocks are interleaved, so the
/// `h` rows' values for weight block `b` sit together at `b * h ..`.
pub struct Acts {
    pub m: usize,
    pub nb: usize,
    qs: Vec<[i8; QK]>,
    /// Scale (f16-rounded).
    d: Vec<f32>,
    /// The same scale in eight lanes: two neighbours are the 512-bit
    /// scale vector of a pair of rows (`x86::pairs512`).
    d8: Vec<[f32; 8]>,
    /// d x sum(qs), rounded like ggml's Q8_1 `s` (for Q4_1's min term).
    s: Vec<f32>,
    /// d x sum(qs), exact (for Q4_0's -8 offset).
    ds: Vec<f32>,
    /// -128 x sum(qs): the offset of Q8_0 weights in groups (stored as
    /// w + 128), the group kernel's starting sum.
    off8: Vec<i32>,
}

/// One tile of [`Acts`]: `h` rows, block `b` of row `ri` at `b * h + ri`.
#[derive(Clone, Copy)]
pub struct Tile<'a> {
    pub h: usize,
    qs: &'a [[i8; QK]],
    d: &'a [f32],
    d8: &'a [[f32; 8]],
    s: &'a [f32],
    ds: &'a [f32],
    off8: &'a [i32],
}

impl Acts {
    /// Where block `b` of row `i` is stored.
    fn at(&self, i: usize, b: usize) -> usize {
        let t0 = i / ROWS * ROWS;
        let h = (self.m - t0).min(ROWS);
        t0 * self.nb + b * h + (i - t0)
    }

    /// The tile of rows `i0..` (`i0` a multiple of `ROWS`).
    pub fn tile(&self, i0: usize) -> Tile<'_> {
        debug_assert_eq!(i0 % ROWS, 0);
        let h = (self.m - i0).min(ROWS);
        let r = i0 * self.nb..(i0 + h) * self.nb;
        Tile {
            h,
            qs: &self.qs[r.clone()],
            d: &self.d[r.clone()],
            d8: &self.d8[r.clone()],
            s: &self.s[r.clone()],
            ds: &self.ds[r.clone()],
            off8: &self.off8[r],
        }
    }
}

/// Quantises `m` rows of `k` activations.
pub fn quantize_rows(x: &[f32], k: usize) -> Acts {
    let nb = k / QK;
    let m = x.len() / k;
    let n = m * nb;
    let mut acts = Acts {
        m,
        nb,
        qs: vec![[0; QK]; n],
        d: vec![0.0; n],
        d8: vec![[0.0; 8]; n],
        s: vec![0.0; n],
        ds: vec![0.0; n],
        off8: vec![0; n],
    };
    let quant = |xs: &[f32]| {
        let (qs, d, sum) = quant::block(xs);
        let d16 = f16::from_f32(d);
        let d = d16.to_f32();
        let s = (f16::from_f32(sum as f32) * d16).to_f32();
        (qs, d, s, sum)
    };
    let blocks: Vec<_> = if x.len() >= 64 * QK {
        x.par_chunks_exact(QK).map(quant).collect()
    } else {
        x.chunks_exact(QK).map(quant).collect()
    };
    for (i, (qs, d, s, sum)) in blocks.into_iter().enumerate() {
        let at = acts.at(i / nb, i % nb);
        acts.qs[at] = qs;
        acts.d[at] = d;
        acts.d8[at] = [d; 8];
        acts.s[at] = s;
        acts.ds[at] = sum as f32 * d;
        acts.off8[at] = -128 * sum;
    }
    acts
}

/// `out[m, n] = x[m, k] . w[n, k]^T`.
pub fn matmul(w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    matmul_many(&[w], x, m)
        .pop()
        .expect("one matrix in, one result out")
}

/// [`matmul`] for several matrices of the same input width (Q, K and V;
/// gate and up): the activations are quantised once and every matrix's
/// rows are shared out in one parallel pass. The results are bit for bit
/// those of separate calls.
pub fn matmul_many(ws: &[&QMatrix], x: &[f32], m: usize) -> Vec<Vec<f32>> {
    let k = ws[0].k;
    assert!(ws.iter().all(|w| w.k == k), "matrices of one input width");
    assert_eq!(x.len(), m * k);
    let acts = quantize_rows(x, k);
    let tiles: Vec<Tile> = (0..m).step_by(ROWS).map(|i0| acts.tile(i0)).collect();
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.n]).collect();
    let threads = rayon::current_num_threads().max(1);
    let total: usize = ws.iter().map(|w| w.n).sum();
    // Whole groups, for matrices in groups.
    let rows_per_task = (total / (threads * 8))
        .clamp(8, 256)
        .next_multiple_of(groups::GROUP);
    // (matrix, first row, end row) of every task.
    let tasks: Vec<(usize, usize, usize)> = ws
        .iter()
        .enumerate()
        .flat_map(|(wi, w)| {
            (0..w.n)
                .step_by(rows_per_task)
                .map(move |j0| (wi, j0, (j0 + rows_per_task).min(w.n)))
        })
        .collect();
    // Each task owns the output columns of its weight rows in every row
    // of its matrix's result: disjoint writes, no transposed copy.
    let dsts: Vec<Columns> = outs.iter_mut().map(|o| Columns(o.as_mut_ptr())).collect();
    tasks.par_iter().for_each(|&(wi, j0, j1)| {
        let (w, dst) = (ws[wi], dsts[wi]);
        let rb = w.row_bytes();
        if w.grouped {
            // Tile by tile over the task's groups (their weights stay in
            // L2 for the next tile); each call writes 16 adjacent columns
            // of each of the tile's 8 rows. Group by group over every tile
            // wrote 16 rows a call instead, and where a row is a multiple
            // of 4 KiB (the 49152-column LM head) those 16 lines share one
            // L1 set of 12 ways: the LM head at 16 rows took 1.62-2.12 ms
            // that way against 1.42-1.45 ms (3 alternating runs).
            let gb = groups::GROUP * rb;
            let (g0, g1) = (j0 / groups::GROUP, j1 / groups::GROUP);
            for (ti, tile) in tiles.iter().enumerate() {
                // SAFETY: rows ti * ROWS.. of the tile are < m, columns
                // j0..j1 are < w.n, and only this task writes them.
                unsafe {
                    dot_groups(
                        w.format,
                        &w.data[g0 * gb..g1 * gb],
                        gb,
                        tile,
                        dst.at((ti * ROWS) * w.n + j0),
                        w.n,
                    )
                };
            }
            return;
        }
        // One tile (decode): all of the task's weight rows in one call.
        // More: a few weight rows against every tile while they are in
        // cache.
        let chunk = if tiles.len() == 1 {
            j1 - j0
        } else {
            CHUNK_ROWS
        };
        let mut res = vec![[0f32; ROWS]; chunk];
        for c0 in (j0..j1).step_by(chunk) {
            let c1 = (c0 + chunk).min(j1);
            let rows = &w.data[c0 * rb..c1 * rb];
            let res = &mut res[..c1 - c0];
            for (ti, tile) in tiles.iter().enumerate() {
                dot_rows(w.format, rows, rb, tile, res);
                for (j, r) in (c0..c1).zip(res.iter()) {
                    for (ri, v) in r.iter().enumerate().take(tile.h) {
                        // SAFETY: row ti * ROWS + ri < m and column j <
                        // w.n are inside this matrix's result, and only
                        // this task writes column j of it.
                        unsafe { dst.write((ti * ROWS + ri) * w.n + j, *v) };
                    }
                }
            }
        }
    });
    outs
}

/// Weight rows per kernel call when there are several activation tiles.
const CHUNK_ROWS: usize = 16;

/// `out`'s buffer, shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct Columns(*mut f32);
// SAFETY: tasks write disjoint elements (see `matmul`) while `out` is
// borrowed by nothing else.
unsafe impl Send for Columns {}
unsafe impl Sync for Columns {}

impl Columns {
    /// Element `at`'s address (the caller keeps inside the buffer).
    fn at(self, at: usize) -> *mut f32 {
        self.0.wrapping_add(at)
    }

    /// # Safety
    /// `at` is inside the buffer and no other thread touches it.
    unsafe fn write(self, at: usize, v: f32) {
        *self.0.add(at) = v;
    }
}

/// Dots each weight row of `rows` (`rb` bytes apiece) with the rows of
/// one activation tile, into `res` (one entry per weight row).
fn dot_rows(f: QFormat, rows: &[u8], rb: usize, tile: &Tile, res: &mut [[f32; ROWS]]) {
    #[cfg(target_arch = "x86_64")]
    {
        match simd() {
            // SAFETY: the CPU has the features each path enables (checked in `simd`).
            Simd::Vnni => return unsafe { x86::dot_tile_vnni(f, rows, rb, tile, res) },
            Simd::Avx2 => return unsafe { x86::dot_tile_avx2(f, rows, rb, tile, res) },
            Simd::None => {}
        }
    }
    for (row, r) in rows.chunks_exact(rb).zip(res) {
        dot_rows_scalar(f, row, tile, r);
    }
}

/// Groups of weight rows (see [`groups`]; `gb` bytes apiece) with the
/// rows of one activation tile: row `ri`'s results for group `i` go to
/// `out[ri * stride + 16 i ..][..16]`.
///
/// # Safety
/// `out` has room for the tile's rows at that stride, and no other thread
/// writes there.
unsafe fn dot_groups(
    f: QFormat,
    groups: &[u8],
    gb: usize,
    tile: &Tile,
    out: *mut f32,
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if simd() == Simd::Vnni {
        // SAFETY: the CPU has the kernel's features (checked in `simd`).
        return unsafe { x86::group_tile_vnni(f, groups, gb, tile, out, stride) };
    }
    for (i, g) in groups.chunks_exact(gb).enumerate() {
        // SAFETY: the caller's promise, for group i's columns.
        unsafe { dot_group_scalar(f, g, tile, out.add(i * groups::GROUP), stride) };
    }
}

/// One group through the scalar reference, row by row.
///
/// # Safety
/// As [`dot_groups`], for one group.
unsafe fn dot_group_scalar(f: QFormat, group: &[u8], tile: &Tile, out: *mut f32, stride: usize) {
    let bb = f.block_bytes();
    let nb = group.len() / (groups::GROUP * bb);
    let mut row = vec![0u8; nb * bb];
    for l in 0..groups::GROUP {
        for (b, blk) in row.chunks_exact_mut(bb).enumerate() {
            groups::gguf_block(f, nb, group, l, b, blk);
        }
        let mut res = [0f32; ROWS];
        dot_rows_scalar(f, &row, tile, &mut res);
        for (ri, v) in res.iter().enumerate().take(tile.h) {
            // SAFETY: the caller's promise.
            unsafe { *out.add(ri * stride + l) = *v };
        }
    }
}

/// Whether matrices are grouped where the CPU allows
/// (`ENVELOPE_QGEMM_SIMD=vnni-rows` keeps the row layout, for comparisons).
fn groups_enabled() -> bool {
    std::env::var("ENVELOPE_QGEMM_SIMD").map_or(true, |v| v != "vnni-rows")
}

/// The widest integer dot product this CPU has, chosen once at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// AVX-512 VNNI (`vpdpbusd`: one instruction for 64 u8 x i8 products
    /// summed in fours).
    Vnni,
    /// AVX2 `maddubs` + `madd`.
    Avx2,
    None,
}

/// The path [`matmul`] takes on this CPU (`ENVELOPE_QGEMM_SIMD=avx2|none`
/// narrows it, for comparisons).
pub fn simd() -> Simd {
    use std::sync::OnceLock;
    static PATH: OnceLock<Simd> = OnceLock::new();
    *PATH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let cap = std::env::var("ENVELOPE_QGEMM_SIMD").unwrap_or_default();
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            let vnni = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni");
            match cap.as_str() {
                "none" => Simd::None,
                "avx2" if avx2 => Simd::Avx2,
                _ if vnni => Simd::Vnni,
                _ if avx2 => Simd::Avx2,
                _ => Simd::None,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Simd::None
    })
}

/// The portable reference, also the oracle for the SIMD paths' tests.
pub fn dot_rows_scalar(f: QFormat, row: &[u8], tile: &Tile, res: &mut [f32; ROWS]) {
    let bb = f.block_bytes();
    let h = tile.h;
    for (ri, out) in res.iter_mut().enumerate().take(h) {
        let mut acc = 0f32;
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let at = b * h + ri;
            let (aq, ad) = (&tile.qs[at], tile.d[at]);
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
                            (q & 0x0F) as i32 * aq[j] as i32 + (q >> 4) as i32 * aq[j + 16] as i32
                        })
                        .sum();
                    acc += sumi as f32 * d * ad;
                    acc += if f == QFormat::Q4_1 {
                        f16_at(blk, 2) * tile.s[at]
                    } else {
                        -8.0 * d * tile.ds[at]
                    };
                }
                QFormat::Q8_0 => {
                    let sumi: i32 = (0..32)
                        .map(|j| blk[2 + j] as i8 as i32 * aq[j] as i32)
                        .sum();
                    acc += sumi as f32 * d * ad;
                }
            }
        }
        *out = acc;
    }
}

mod groups;
mod quant;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
