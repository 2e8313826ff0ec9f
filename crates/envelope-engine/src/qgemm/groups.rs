//! Weight rows repacked in groups of [`GROUP`] for the VNNI group kernel
//! (`x86::group_tile_vnni`): one 512-bit `vpdpbusd` takes four
//! consecutive bytes of each of 16 weight rows against four activation
//! bytes broadcast to every lane, so one instruction advances 16 output
//! columns of one activation row, and the scales are applied to 16
//! columns at once. The row kernels apply them per row and block, which
//! made that float work (convert, scale, accumulate) most of a batched
//! step's matmul time. llama.cpp's CPU backend repacks Q4_0 for the same
//! reason (its "repack" buffer type); this layout is ours.
//!
//! One group block (the same block `b` of 16 rows), for Q4_0 and Q4_1:
//! 16 f16 scales, for Q4_1 16 f16 minimums, then 4 chunks of 64 bytes,
//! chunk `c` holding bytes `4c..4c + 4` of each row's 16 packed nibble
//! bytes (row after row). The low nibbles of chunk `c` are elements
//! `4c..4c + 4`, the high ones `16 + 4c..`. Q8_0: 16 f16 scales, then 8
//! chunks of 64 bytes, chunk `c` holding elements `4c..4c + 4` of each
//! row as `w + 128` (`vpdpbusd` multiplies unsigned by signed bytes; the
//! kernel takes 128 x the activations' block sum back off, exactly).
//! A group block is as long as 16 GGUF blocks, so the matrix keeps its
//! size.

use super::{QFormat, QK};

/// Weight rows per group: the f32 lanes of a 512-bit vector.
pub const GROUP: usize = 16;

/// Offset of the quantised bytes in a group block.
pub fn qs_at(f: QFormat) -> usize {
    match f {
        QFormat::Q4_1 => 4 * GROUP,
        QFormat::Q4_0 | QFormat::Q8_0 => 2 * GROUP,
    }
}

/// `data` (GGUF rows, `n` a multiple of [`GROUP`]) in groups.
pub fn pack(f: QFormat, n: usize, k: usize, data: &[u8]) -> Vec<u8> {
    debug_assert!(n.is_multiple_of(GROUP));
    let bb = f.block_bytes();
    let nb = k / QK;
    let rb = nb * bb;
    let mut out = vec![0u8; data.len()];
    let gb = GROUP * bb;
    for g in 0..n / GROUP {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * gb..(g * nb + b + 1) * gb];
            for l in 0..GROUP {
                let src = &data[(g * GROUP + l) * rb + b * bb..][..bb];
                dst[2 * l..2 * l + 2].copy_from_slice(&src[..2]);
                let qs = match f {
                    QFormat::Q4_1 => {
                        dst[2 * GROUP + 2 * l..2 * GROUP + 2 * l + 2].copy_from_slice(&src[2..4]);
                        &src[4..]
                    }
                    QFormat::Q4_0 | QFormat::Q8_0 => &src[2..],
                };
                for (i, q) in qs.iter().enumerate() {
                    let at = qs_at(f) + i / 4 * 4 * GROUP + 4 * l + i % 4;
                    dst[at] = if f == QFormat::Q8_0 { q ^ 0x80 } else { *q };
                }
            }
        }
    }
    out
}

/// Block `b` of row `j` as GGUF stores it (the embedding lookup reads
/// rows of a packed matrix through this).
pub fn gguf_block(f: QFormat, nb: usize, data: &[u8], j: usize, b: usize, out: &mut [u8]) {
    let bb = f.block_bytes();
    let (g, l) = (j / GROUP, j % GROUP);
    let src = &data[(g * nb + b) * GROUP * bb..][..GROUP * bb];
    out[..2].copy_from_slice(&src[2 * l..2 * l + 2]);
    let qs = match f {
        QFormat::Q4_1 => {
            out[2..4].copy_from_slice(&src[2 * GROUP + 2 * l..2 * GROUP + 2 * l + 2]);
            &mut out[4..bb]
        }
        QFormat::Q4_0 | QFormat::Q8_0 => &mut out[2..bb],
    };
    for (i, q) in qs.iter_mut().enumerate() {
        let v = src[qs_at(f) + i / 4 * 4 * GROUP + 4 * l + i % 4];
        *q = if f == QFormat::Q8_0 { v ^ 0x80 } else { v };
    }
}
