//! `kernels/gemm.cu`'s tensor-core kernel, replayed on the CPU: the tile
//! loads (zero fill at the edges), each lane's
//! registers as the kernel reads them from shared memory, the `mma.sync
//! m16n8k16` fragment layout of the PTX ISA (16-bit A and B, f32 C/D), and
//! the epilogue's output indices. It must give `x W^T` on shapes with
//! partial tiles in every dimension. No GPU runs this; it checks the index
//! arithmetic a GPU run would otherwise be the first to test (the GPU
//! self-test then checks the arithmetic itself).

#![allow(clippy::needless_range_loop)] // indices mirror the kernel's

use envelope_cuda::geometry::{gemm, GEMM_TILE};
use envelope_cuda::reference::gemm_tn;

const BM: usize = 64;
const BN: usize = 64;
const BK: usize = 32;
const LDS: usize = BK + 8;

/// `load_tile`: the [64, 32] tile at (row0, k0), stride LDS, zero outside.
/// The kernel's vector path moves eight elements at once only when all
/// eight are inside the matrix, so both paths store these values.
fn load_tile(src: &[f32], n_rows: usize, inner: usize, row0: usize, k0: usize) -> Vec<f32> {
    let mut dst = vec![f32::NAN; BM * LDS];
    for v in 0..BM * BK / 8 {
        let (r, c) = (v / (BK / 8), (v % (BK / 8)) * 8);
        let (gr, gk) = (row0 + r, k0 + c);
        for i in 0..8 {
            dst[r * LDS + c + i] = if gr < n_rows && gk + i < inner {
                src[gr * inner + gk + i]
            } else {
                0.0
            };
        }
    }
    dst
}

/// The PTX ISA's m16n8k16 layout (g = lane / 4, t = lane % 4): element
/// `h` (0 low, 1 high half) of A register `reg` is A[g + 8 (reg % 2)][2t +
/// h + 8 (reg / 2)]; of B register `reg`, B[2t + h + 8 reg][g]; D element
/// `f` is D[g + 8 (f / 2)][2t + f % 2].
fn mma(d: &mut [[f32; 4]; 32], a: &[[[f32; 2]; 4]; 32], b: &[[[f32; 2]; 2]; 32]) {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for reg in 0..4 {
            for h in 0..2 {
                am[g + 8 * (reg % 2)][2 * t + h + 8 * (reg / 2)] = a[lane][reg][h];
            }
        }
        for reg in 0..2 {
            for h in 0..2 {
                bm[2 * t + h + 8 * reg][g] = b[lane][reg][h];
            }
        }
    }
    for (lane, dl) in d.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (f, v) in dl.iter_mut().enumerate() {
            let (row, col) = (g + 8 * (f / 2), 2 * t + f % 2);
            *v += (0..16).map(|k| am[row][k] * bm[k][col]).sum::<f32>();
        }
    }
}

/// `gemm_tc` for one block (bx over out, by over rows), written into `y`.
fn block(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    (rows, inner, out): (usize, usize, usize),
    (bx, by): (usize, usize),
    accumulate: bool,
) {
    let (row0, col0) = (by * BM, bx * BN);
    // [warp][i][j][lane][fragment]
    let mut acc = vec![[[[[0f32; 4]; 32]; 4]; 2]; 4];
    let mut k0 = 0;
    while k0 < inner {
        let xs = load_tile(x, rows, inner, row0, k0);
        let ws = load_tile(w, out, inner, col0, k0);
        for (warp, acc_w) in acc.iter_mut().enumerate() {
            let (wm, wn) = ((warp >> 1) * 32, (warp & 1) * 32);
            for kk in (0..BK).step_by(16) {
                let pair = |s: &[f32], at: usize| [s[at], s[at + 1]];
                let mut a = [[[[0f32; 2]; 4]; 32]; 2];
                let mut b = [[[[0f32; 2]; 2]; 32]; 4];
                for lane in 0..32 {
                    let (g, t) = (lane >> 2, lane & 3);
                    for (i, ai) in a.iter_mut().enumerate() {
                        let p = (wm + i * 16 + g) * LDS + kk + 2 * t;
                        ai[lane] = [
                            pair(&xs, p),
                            pair(&xs, p + 8 * LDS),
                            pair(&xs, p + 8),
                            pair(&xs, p + 8 * LDS + 8),
                        ];
                    }
                    for (j, bj) in b.iter_mut().enumerate() {
                        let p = (wn + j * 8 + g) * LDS + kk + 2 * t;
                        bj[lane] = [pair(&ws, p), pair(&ws, p + 8)];
                    }
                }
                for (i, acc_i) in acc_w.iter_mut().enumerate() {
                    for (j, acc_ij) in acc_i.iter_mut().enumerate() {
                        mma(acc_ij, &a[i], &b[j]);
                    }
                }
            }
        }
        k0 += BK;
    }
    for (warp, acc_w) in acc.iter().enumerate() {
        let (wm, wn) = ((warp >> 1) * 32, (warp & 1) * 32);
        for lane in 0..32 {
            let (g, t) = (lane >> 2, lane & 3);
            for (i, acc_i) in acc_w.iter().enumerate() {
                for (j, acc_ij) in acc_i.iter().enumerate() {
                    for f in 0..4 {
                        let gr = row0 + wm + i * 16 + g + (f >> 1) * 8;
                        let gc = col0 + wn + j * 8 + 2 * t + (f & 1);
                        if gr >= rows || gc >= out {
                            continue;
                        }
                        let v = acc_ij[lane][f];
                        y[gr * out + gc] = if accumulate { y[gr * out + gc] + v } else { v };
                    }
                }
            }
        }
    }
}

fn run(dims: (usize, usize, usize), accumulate: bool) {
    let (rows, inner, out) = dims;
    // Small integers: every product and sum is exact in f32, so the replay
    // must equal the reference exactly.
    let val = |i: usize, m: usize| ((i * 7919 + m) % 9) as f32 - 4.0;
    let x: Vec<f32> = (0..rows * inner).map(|i| val(i, 3)).collect();
    let w: Vec<f32> = (0..out * inner).map(|i| val(i, 5)).collect();
    let y0: Vec<f32> = (0..rows * out).map(|i| val(i, 1)).collect();
    let l = gemm(rows, out, false).unwrap();
    let mut y = y0.clone();
    for by in 0..l.grid.1 as usize {
        for bx in 0..l.grid.0 as usize {
            block(&x, &w, &mut y, dims, (bx, by), accumulate);
        }
    }
    let want = gemm_tn(&x, &w, accumulate.then_some(&y0[..]), dims, 1.0);
    assert_eq!(y, want, "{dims:?} accumulate={accumulate}");
}

#[test]
fn the_tensor_core_kernel_computes_x_times_w_transposed() {
    assert_eq!((BM, BN), (GEMM_TILE, GEMM_TILE));
    // A decode row, partial tiles in every dimension, a K tile that ends
    // inside an 8-element vector, several K tiles with the residual add.
    run((1, 64, 96), false);
    run((70, 200, 130), false);
    run((37, 100, 45), false);
    run((128, 96, 72), true);
}

#[test]
fn a_wrong_fragment_layout_is_caught() {
    // One 16x8x16 tile with the kernel's register loads gives x W^T; with
    // the k halves of B's registers swapped it must not, or the replay
    // would not test the layout.
    let (rows, inner, out) = (16, 16, 8);
    let x: Vec<f32> = (0..rows * inner).map(|i| (i % 5) as f32).collect();
    let w: Vec<f32> = (0..out * inner).map(|i| (i % 3) as f32).collect();
    let xs = load_tile(&x, rows, inner, 0, 0);
    let ws = load_tile(&w, out, inner, 0, 0);
    let want = gemm_tn(&x, &w, None, (rows, inner, out), 1.0);
    let product = |swap_b: bool| {
        let mut a = [[[0f32; 2]; 4]; 32];
        let mut b = [[[0f32; 2]; 2]; 32];
        for lane in 0..32 {
            let (g, t) = (lane >> 2, lane & 3);
            let p = g * LDS + 2 * t;
            a[lane] = [
                [xs[p], xs[p + 1]],
                [xs[p + 8 * LDS], xs[p + 8 * LDS + 1]],
                [xs[p + 8], xs[p + 9]],
                [xs[p + 8 * LDS + 8], xs[p + 8 * LDS + 9]],
            ];
            let (lo, hi) = ([ws[p], ws[p + 1]], [ws[p + 8], ws[p + 9]]);
            b[lane] = if swap_b { [hi, lo] } else { [lo, hi] };
        }
        let mut d = [[0f32; 4]; 32];
        mma(&mut d, &a, &b);
        (0..rows * out)
            .map(|e| {
                let (r, c) = (e / out, e % out);
                d[(r % 8) * 4 + c / 2][(r / 8) * 2 + c % 2]
            })
            .collect::<Vec<f32>>()
    };
    assert_eq!(product(false), want);
    assert_ne!(product(true), want);
}
