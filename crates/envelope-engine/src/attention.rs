//! Paged attention on the CPU. New tokens' K/V are written into their slots
//! first; then every query reads its sequence's keys through the block
//! table, so prefill chunks, decode steps and recomputation after preemption
//! all go through the same code. No n x n score matrix is ever built: a
//! query keeps one row of scores.

use crate::kv_cache::{KvElem, KvGeometry, LayerKv};
use rayon::prelude::*;

/// Where one new token sits: its sequence's block table and its position.
#[derive(Debug, Clone, Copy)]
pub struct TokenSlot<'a> {
    pub block_table: &'a [u32],
    pub pos: usize,
}

/// Writes each token's K and V (`[tokens, kv_heads * head_dim]`) into the pool.
pub fn write_kv<T: KvElem>(
    g: &KvGeometry,
    layer: &mut LayerKv<T>,
    slots: &[TokenSlot],
    k: &[f32],
    v: &[f32],
) {
    let stride = g.token_stride();
    for (i, s) in slots.iter().enumerate() {
        let block = s.block_table[s.pos / g.block_size];
        let off = g.offset(block, s.pos % g.block_size);
        for (dst, src) in layer.k[off..off + stride]
            .iter_mut()
            .zip(&k[i * stride..(i + 1) * stride])
        {
            *dst = T::from_f32(*src);
        }
        for (dst, src) in layer.v[off..off + stride]
            .iter_mut()
            .zip(&v[i * stride..(i + 1) * stride])
        {
            *dst = T::from_f32(*src);
        }
    }
}

#[inline(always)]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    // Eight independent lanes so the compiler emits vector FMAs (AVX2 with
    // x86-64-v3); chunks_exact removes the per-element bounds checks.
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y.to_f32())
        .sum();
    for (x, y) in ac.zip(bc) {
        for j in 0..8 {
            acc[j] += x[j] * y[j].to_f32();
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn axpy<T: KvElem>(out: &mut [f32], p: f32, v: &[T]) {
    for (o, x) in out.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
        for j in 0..8 {
            o[j] += p * x[j].to_f32();
        }
    }
    let done = out.len() / 8 * 8;
    for (o, x) in out[done..].iter_mut().zip(&v[done..]) {
        *o += p * x.to_f32();
    }
}

/// Causal attention of every new token over its sequence's cached keys
/// (positions `0..=pos`). `q` is `[tokens, num_heads * head_dim]`; the
/// result has the same shape.
pub fn paged_attention<T: KvElem>(
    g: &KvGeometry,
    layer: &LayerKv<T>,
    slots: &[TokenSlot],
    q: &[f32],
    num_heads: usize,
) -> Vec<f32> {
    let hd = g.head_dim;
    let group = num_heads / g.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; slots.len() * num_heads * hd];
    // One task per (token, kv head): the group's query heads share each key load.
    out.par_chunks_mut(group * hd)
        .enumerate()
        .for_each(|(task, out)| {
            let (tok, kvh) = (task / g.num_kv_heads, task % g.num_kv_heads);
            let s = slots[tok];
            let n = s.pos + 1;
            let q_base = tok * num_heads * hd + kvh * group * hd;
            let mut scores = vec![0f32; group * n];
            let stride = g.token_stride();
            let qs = &q[q_base..q_base + group * hd];
            // Walk the sequence's blocks; inside a block, slots are contiguous.
            for (bi, &block) in s.block_table.iter().enumerate() {
                let t0 = bi * g.block_size;
                if t0 >= n {
                    break;
                }
                let base = g.offset(block, 0) + kvh * hd;
                for slot in 0..g.block_size.min(n - t0) {
                    let key = &layer.k[base + slot * stride..base + slot * stride + hd];
                    for (h, qh) in qs.chunks_exact(hd).enumerate() {
                        scores[h * n + t0 + slot] = dot(qh, key) * scale;
                    }
                }
            }
            for row in scores.chunks_exact_mut(n) {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in row.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                row.iter_mut().for_each(|x| *x *= inv);
            }
            for (bi, &block) in s.block_table.iter().enumerate() {
                let t0 = bi * g.block_size;
                if t0 >= n {
                    break;
                }
                let base = g.offset(block, 0) + kvh * hd;
                for slot in 0..g.block_size.min(n - t0) {
                    let val = &layer.v[base + slot * stride..base + slot * stride + hd];
                    for (h, o) in out.chunks_exact_mut(hd).enumerate() {
                        axpy(o, scores[h * n + t0 + slot], val);
                    }
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense reference: softmax(q k^T / sqrt(d)) v over positions 0..=pos.
    fn reference(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], pos: usize) -> Vec<f32> {
        let d = q.len();
        let s: Vec<f32> = (0..=pos)
            .map(|t| q.iter().zip(&ks[t]).map(|(a, b)| a * b).sum::<f32>() / (d as f32).sqrt())
            .collect();
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum();
        (0..d)
            .map(|j| (0..=pos).map(|t| e[t] / z * vs[t][j]).sum())
            .collect()
    }

    #[test]
    fn paged_matches_dense_with_scattered_blocks_and_gqa() {
        let g = KvGeometry {
            num_layers: 1,
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let heads = 4;
        let mut layer = LayerKv {
            k: vec![0f32; g.layer_elems()],
            v: vec![0f32; g.layer_elems()],
        };
        let table = [5u32, 1, 6]; // out of order on purpose
        let n = 10;
        let rnd = |i: usize| ((i * 7919 % 113) as f32 / 113.0) - 0.5;
        let stride = g.token_stride();
        let k: Vec<f32> = (0..n * stride).map(rnd).collect();
        let v: Vec<f32> = (0..n * stride).map(|i| rnd(i + 5000)).collect();
        let slots: Vec<TokenSlot> = (0..n)
            .map(|pos| TokenSlot {
                block_table: &table,
                pos,
            })
            .collect();
        write_kv(&g, &mut layer, &slots, &k, &v);
        let q: Vec<f32> = (0..n * heads * 8).map(|i| rnd(i + 9000)).collect();
        let out = paged_attention(&g, &layer, &slots, &q, heads);
        for pos in 0..n {
            for h in 0..heads {
                let kvh = h / 2;
                let ks: Vec<Vec<f32>> = (0..n)
                    .map(|t| k[t * stride + kvh * 8..t * stride + kvh * 8 + 8].to_vec())
                    .collect();
                let vs: Vec<Vec<f32>> = (0..n)
                    .map(|t| v[t * stride + kvh * 8..t * stride + kvh * 8 + 8].to_vec())
                    .collect();
                let qh = &q[(pos * heads + h) * 8..(pos * heads + h + 1) * 8];
                let want = reference(qh, &ks, &vs, pos);
                let got = &out[(pos * heads + h) * 8..(pos * heads + h + 1) * 8];
                for (a, b) in want.iter().zip(got) {
                    assert!((a - b).abs() < 1e-5, "pos {pos} head {h}: {a} vs {b}");
                }
            }
        }
    }
}
