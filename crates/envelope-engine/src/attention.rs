//! Paged attention on the CPU. New tokens' K/V are written into their slots
//! first; then every query reads its sequence's keys through the block
//! table, so prefill chunks, decode steps and recomputation after preemption
//! all go through the same code. No n x n score matrix is ever built: a
//! query keeps one row of scores.

use crate::activation::exp;
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
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight lanes, multiply then add (not fused: the rounding candle's
    // reference has; tests/reference_logits compares 16 greedy tokens with
    // it), then a tree over the lanes. The AVX2 build (x86-64-v3, this
    // project's target) spells it out: left to itself the compiler
    // vectorised it two lanes wide.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if a.len() == b.len() && a.len().is_multiple_of(8) {
        // SAFETY: AVX2 is enabled at compile time; every load is inside
        // `a` and `b` (equal lengths, whole chunks of 8).
        return unsafe { dot_avx2(a, b) };
    }
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    // A tree, not a chain of seven dependent adds.
    let h: [f32; 4] = std::array::from_fn(|j| acc[j] + acc[j + 4]);
    (h[0] + h[2]) + (h[1] + h[3]) + tail
}

/// [`dot`]'s arithmetic, lane for lane, in AVX2.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for c in (0..a.len()).step_by(8) {
        let x = _mm256_loadu_ps(a.as_ptr().add(c));
        let y = _mm256_loadu_ps(b.as_ptr().add(c));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
    }
    // h[j] = acc[j] + acc[j + 4], then (h0 + h2) + (h1 + h3).
    let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    // The portable path then adds its empty tail, -0.0: no change.
    _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)))
}

#[inline(always)]
fn axpy(out: &mut [f32], p: f32, v: &[f32]) {
    for (o, x) in out.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
        for j in 0..8 {
            o[j] += p * x[j];
        }
    }
    let done = out.len() / 8 * 8;
    for (o, x) in out[done..].iter_mut().zip(&v[done..]) {
        *o += p * x;
    }
}

/// `out[i] = dot(q, key i) * scale` for the `n` keys `keys[i * ks..][..hd]`:
/// [`dot`]'s arithmetic, four keys at a time on AVX2 (four independent
/// sums, one horizontal reduction for the four).
#[inline(always)]
fn scores_run(q: &[f32], keys: &[f32], ks: usize, n: usize, scale: f32, out: &mut [f32]) {
    let hd = q.len();
    let mut i = 0;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if hd.is_multiple_of(8) {
        while i + 4 <= n {
            assert!((i + 3) * ks + hd <= keys.len());
            // SAFETY: AVX2 is enabled at compile time; the four keys are
            // inside `keys` (asserted) and `q` is whole chunks of 8.
            let s = unsafe { dot4_avx2(q, keys.as_ptr().add(i * ks), ks) };
            for (o, v) in out[i..i + 4].iter_mut().zip(s) {
                *o = v * scale;
            }
            i += 4;
        }
    }
    for (i, o) in out.iter_mut().enumerate().take(n).skip(i) {
        *o = dot(q, &keys[i * ks..i * ks + hd]) * scale;
    }
}

/// Four [`dot_avx2`]s of `q` with the keys at `k`, `k + ks`, `k + 2 ks`
/// and `k + 3 ks`, lane for lane the same arithmetic.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
unsafe fn dot4_avx2(q: &[f32], k: *const f32, ks: usize) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut a = [_mm256_setzero_ps(); 4];
    for c in (0..q.len()).step_by(8) {
        let x = _mm256_loadu_ps(q.as_ptr().add(c));
        for (j, a) in a.iter_mut().enumerate() {
            *a = _mm256_add_ps(*a, _mm256_mul_ps(x, _mm256_loadu_ps(k.add(j * ks + c))));
        }
    }
    // Per key h[j] = acc[j] + acc[j + 4]; then (h0 + h2) + (h1 + h3) for
    // the four keys at once, through a transpose.
    let h = a.map(|a| _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
    let s01 = _mm_add_ps(_mm_unpacklo_ps(h[0], h[1]), _mm_unpackhi_ps(h[0], h[1]));
    let s23 = _mm_add_ps(_mm_unpacklo_ps(h[2], h[3]), _mm_unpackhi_ps(h[2], h[3]));
    // [h0 + h2 of each key] + [h1 + h3 of each key].
    let r = _mm_add_ps(_mm_movelh_ps(s01, s23), _mm_movehl_ps(s23, s01));
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), r);
    out
}

/// `out += p[i] * vals[i * vs..][..hd]` for `i` in `0..n`, in order: each
/// element gets [`axpy`]'s adds in the same order, but on AVX2 `out` stays
/// in registers across the `n` rows (64 columns at a time).
#[inline(always)]
fn values_run(out: &mut [f32], p: &[f32], vals: &[f32], vs: usize, n: usize) {
    let hd = out.len();
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(64) && avx512() {
        assert!(n == 0 || (n - 1) * vs + hd <= vals.len());
        assert!(p.len() >= n);
        for c in (0..hd).step_by(64) {
            // SAFETY: the CPU has AVX-512F (checked); columns c..c + 64 of
            // the n rows are inside `vals` (asserted) and of `out`.
            unsafe { values_512(&mut out[c..c + 64], p, vals.as_ptr().add(c), vs, n) };
        }
        return;
    }
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    if hd.is_multiple_of(8) {
        assert!(n == 0 || (n - 1) * vs + hd <= vals.len());
        assert!(p.len() >= n);
        let mut c = 0;
        // SAFETY (both calls): AVX2 is enabled at compile time; columns
        // c..c + 8W of the n rows are inside `vals` (asserted) and of `out`.
        while c + 64 <= hd {
            unsafe { values_avx2::<8>(&mut out[c..c + 64], p, vals.as_ptr().add(c), vs, n) };
            c += 64;
        }
        while c < hd {
            unsafe { values_avx2::<1>(&mut out[c..c + 8], p, vals.as_ptr().add(c), vs, n) };
            c += 8;
        }
        return;
    }
    for (i, &pi) in p.iter().enumerate().take(n) {
        axpy(out, pi, &vals[i * vs..i * vs + hd]);
    }
}

/// [`values_run`] for `8 W` columns held in `W` registers.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
unsafe fn values_avx2<const W: usize>(
    out: &mut [f32],
    p: &[f32],
    v: *const f32,
    vs: usize,
    n: usize,
) {
    use std::arch::x86_64::*;
    let mut o: [__m256; W] = std::array::from_fn(|r| _mm256_loadu_ps(out.as_ptr().add(8 * r)));
    for (i, &pi) in p.iter().enumerate().take(n) {
        let w = _mm256_set1_ps(pi);
        let row = v.add(i * vs);
        for (r, o) in o.iter_mut().enumerate() {
            *o = _mm256_add_ps(*o, _mm256_mul_ps(w, _mm256_loadu_ps(row.add(8 * r))));
        }
    }
    for (r, o) in o.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * r), *o);
    }
}

/// Whether the CPU has AVX-512F (checked once): [`values_run`] then takes
/// 16 columns a vector where the AVX2 build takes 8.
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f"))
}

/// [`values_run`] for 64 columns in four 512-bit registers: per element
/// the same multiply and add, in the same order, as [`axpy`].
///
/// # Safety
/// The CPU has AVX-512F; `out` has 64 elements, and each of the `n` rows
/// at `v + i * vs` has 64 readable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn values_512(out: &mut [f32], p: &[f32], v: *const f32, vs: usize, n: usize) {
    use std::arch::x86_64::*;
    debug_assert_eq!(out.len(), 64);
    let at = out.as_mut_ptr();
    let mut o = [
        _mm512_loadu_ps(at),
        _mm512_loadu_ps(at.add(16)),
        _mm512_loadu_ps(at.add(32)),
        _mm512_loadu_ps(at.add(48)),
    ];
    for (i, &pi) in p.iter().enumerate().take(n) {
        let w = _mm512_set1_ps(pi);
        let row = v.add(i * vs);
        for (r, o) in o.iter_mut().enumerate() {
            *o = _mm512_add_ps(*o, _mm512_mul_ps(w, _mm512_loadu_ps(row.add(16 * r))));
        }
    }
    for (r, o) in o.iter().enumerate() {
        _mm512_storeu_ps(at.add(16 * r), *o);
    }
}

/// The largest value of `xs` (eight lanes, so it vectorises).
#[inline(always)]
fn max_of(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for j in 0..8 {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    m.iter().copied().fold(tail, f32::max)
}

/// Replaces each `x` by `exp(x - max)` and returns their sum.
#[inline(always)]
fn exp_and_sum(xs: &mut [f32], max: f32) -> f32 {
    for x in xs.iter_mut() {
        *x = exp(*x - max);
    }
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Positions per attention share. Fixed, so a token's attention is the
/// same arithmetic whatever else is in the step (batched, prefilled or
/// recomputed after preemption, its output is bit for bit the same).
const SHARE: usize = 128;

/// Positions read at once: their keys and values are widened once, and
/// each head's output stays in registers across them.
const RUN: usize = 16;

/// Positions that sit in one block (inside a block, slots are
/// `token_stride` apart), at most [`RUN`] of them.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// The first position, less the share's first.
    first: usize,
    /// Where the first position's K/V head starts in the layer.
    at: usize,
    /// Positions in the run.
    len: usize,
}

/// The runs that cover positions `p0..p1` of KV head `kvh`.
fn runs(g: &KvGeometry, s: TokenSlot, kvh: usize, (p0, p1): (usize, usize)) -> Vec<Run> {
    let mut runs = Vec::with_capacity((p1 - p0).div_ceil(RUN.min(g.block_size)) + 1);
    let mut p = p0;
    while p < p1 {
        let block = s.block_table[p / g.block_size];
        let end = p1.min((p / g.block_size + 1) * g.block_size).min(p + RUN);
        runs.push(Run {
            first: p - p0,
            at: g.offset(block, p % g.block_size) + kvh * g.head_dim,
            len: end - p,
        });
        p = end;
    }
    runs
}

/// Asks the CPU to start loading `n` rows of `hd` elements, `stride` apart
/// from `src[at]`, into its caches: the rows of one head sit 1 in
/// `num_kv_heads` of the cache lines, in blocks scattered over the pool,
/// a pattern the hardware prefetcher does not follow.
#[inline(always)]
fn prefetch_rows<T>(src: &[T], at: usize, stride: usize, n: usize, hd: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = hd * std::mem::size_of::<T>();
        for i in 0..n {
            let Some(row) = src.get(at + i * stride..at + i * stride + hd) else {
                return;
            };
            let row = row.as_ptr() as *const i8;
            for off in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint that loads nothing into
                // the program; the address is inside `row`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(row.add(off)) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, at, stride, n, hd);
}

/// One task's share: the group's query heads of token `tok` over KV head
/// `kvh`, positions `p0..p1`. When the share is the token's whole context
/// (`whole`), `out` is the attention output. Otherwise the scores stay
/// unnormalised: `max[h]` and `sum[h]` (of `exp(score - max)`) come back
/// with `out` = the `exp`-weighted sum of values, so the shares of one
/// token merge exactly (the flash-decoding split).
struct Share {
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn attend_share<T: KvElem>(
    g: &KvGeometry,
    layer: &LayerKv<T>,
    s: TokenSlot,
    qs: &[f32],
    kvh: usize,
    (p0, p1): (usize, usize),
    whole: bool,
    scale: f32,
    out: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let hd = g.head_dim;
    let group = qs.len() / hd;
    let n = p1 - p0;
    let stride = g.token_stride();
    let mut scores = vec![0f32; group * n];
    // Widened K/V rows of one run (f32 rows are read where they are).
    let mut buf = vec![0f32; if T::WIDENS { RUN * hd } else { 0 }];
    let runs = runs(g, s, kvh, (p0, p1));
    for (
        i,
        &Run {
            first: t,
            at,
            len: m,
        },
    ) in runs.iter().enumerate()
    {
        // The next run's keys, and this run's values for the pass below.
        if let Some(next) = runs.get(i + 1) {
            prefetch_rows(&layer.k, next.at, stride, next.len, hd);
        }
        prefetch_rows(&layer.v, at, stride, m, hd);
        let span = (m - 1) * stride + hd;
        let (keys, ks) = T::rows(&layer.k[at..at + span], stride, m, hd, &mut buf);
        for (h, qh) in qs.chunks_exact(hd).enumerate() {
            scores_run(
                qh,
                keys,
                ks,
                m,
                scale,
                &mut scores[h * n + t..h * n + t + m],
            );
        }
    }
    let mut maxes = vec![0f32; group];
    let mut sums = vec![0f32; group];
    for (h, row) in scores.chunks_exact_mut(n).enumerate() {
        let max = max_of(row);
        maxes[h] = max;
        sums[h] = exp_and_sum(row, max);
        if whole {
            let inv = 1.0 / sums[h];
            row.iter_mut().for_each(|x| *x *= inv);
        }
    }
    for &Run {
        first: t,
        at,
        len: m,
    } in &runs
    {
        let span = (m - 1) * stride + hd;
        let (vals, vs) = T::rows(&layer.v[at..at + span], stride, m, hd, &mut buf);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            values_run(o, &scores[h * n + t..h * n + t + m], vals, vs, m);
        }
    }
    (maxes, sums)
}

/// Causal attention of every new token over its sequence's cached keys
/// (positions `0..=pos`). `q` is `[tokens, num_heads * head_dim]`; the
/// result has the same shape. One task per (token, KV head, [`SHARE`]
/// positions): the group's query heads share each key load, and a long
/// sequence's shares run on several threads (decode of a few long
/// sequences) before they are merged (the flash-decoding split).
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
    let q_of = |task: usize| {
        let (tok, kvh) = (task / g.num_kv_heads, task % g.num_kv_heads);
        let at = tok * num_heads * hd + kvh * group * hd;
        (tok, kvh, &q[at..at + group * hd])
    };
    // The share of task `task` from position `p0`.
    let share = |task: usize, p0: usize| {
        let (tok, kvh, qs) = q_of(task);
        let s = slots[tok];
        let p1 = (p0 + SHARE).min(s.pos + 1);
        let whole = p0 == 0 && p1 == s.pos + 1;
        let mut out = vec![0f32; group * hd];
        let (max, sum) = attend_share(g, layer, s, qs, kvh, (p0, p1), whole, scale, &mut out);
        Share { max, sum, out }
    };
    let tasks = slots.len() * g.num_kv_heads;
    let threads = rayon::current_num_threads().max(1);
    if tasks >= 4 * threads || slots.iter().all(|s| s.pos < SHARE) {
        // Tasks enough for the threads (prefill, large batches): each runs
        // its shares in turn and merges them, so no more than one task's
        // shares per thread are held at once.
        out.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(task, out)| {
                let (tok, kvh, qs) = q_of(task);
                let s = slots[tok];
                if s.pos < SHARE {
                    attend_share(g, layer, s, qs, kvh, (0, s.pos + 1), true, scale, out);
                } else {
                    let mine: Vec<Share> = (0..=s.pos)
                        .step_by(SHARE)
                        .map(|p0| share(task, p0))
                        .collect();
                    merge(&mine, out, hd);
                }
            });
        return out;
    }
    // Few tasks over long contexts (decode of a few sequences): every share
    // is a task of its own; then each token's shares merge, in order.
    let parts: Vec<(usize, usize)> = (0..tasks)
        .flat_map(|task| {
            let n = slots[task / g.num_kv_heads].pos + 1;
            (0..n).step_by(SHARE).map(move |p0| (task, p0))
        })
        .collect();
    let shares: Vec<Share> = parts.par_iter().map(|&(t, p0)| share(t, p0)).collect();
    for (task, o) in out.chunks_exact_mut(group * hd).enumerate() {
        let first = parts.partition_point(|p| p.0 < task);
        let n = parts[first..].iter().take_while(|p| p.0 == task).count();
        let mine = &shares[first..first + n];
        if n == 1 {
            // The whole context in one share: already the output.
            o.copy_from_slice(&mine[0].out);
        } else {
            merge(mine, o, hd);
        }
    }
    out
}

/// Merges one token's shares (in position order) into its group's
/// outputs `o` (`[group, hd]`).
fn merge(mine: &[Share], o: &mut [f32], hd: usize) {
    for (h, o) in o.chunks_exact_mut(hd).enumerate() {
        let max = mine
            .iter()
            .map(|p| p.max[h])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for p in mine {
            let w = exp(p.max[h] - max);
            sum += w * p.sum[h];
            axpy(o, w, &p.out[h * hd..(h + 1) * hd]);
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
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

    /// Writes `n` tokens through a block table in scattered order, then
    /// attends the tokens at `query_pos` (all of them, or the last one
    /// alone as in decode) and checks each head against the dense reference.
    fn check(block_size: usize, n: usize, query_pos: &[usize]) -> Vec<f32> {
        let g = KvGeometry {
            num_layers: 1,
            num_blocks: n.div_ceil(block_size) + 4,
            block_size,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let heads = 4;
        let mut layer = LayerKv {
            k: vec![0f32; g.layer_elems()],
            v: vec![0f32; g.layer_elems()],
        };
        // Out of order on purpose.
        let table: Vec<u32> = (0..n.div_ceil(block_size) as u32)
            .map(|b| (b * 5 + 3) % g.num_blocks as u32)
            .collect();
        let rnd = |i: usize| ((i * 7919 % 113) as f32 / 113.0) - 0.5;
        let stride = g.token_stride();
        let k: Vec<f32> = (0..n * stride).map(|i| 3.0 * rnd(i)).collect();
        let v: Vec<f32> = (0..n * stride).map(|i| rnd(i + 5000)).collect();
        let slots: Vec<TokenSlot> = (0..n)
            .map(|pos| TokenSlot {
                block_table: &table,
                pos,
            })
            .collect();
        write_kv(&g, &mut layer, &slots, &k, &v);
        let queries: Vec<TokenSlot> = query_pos.iter().map(|&p| slots[p]).collect();
        // Each query depends on its position only, not on its place in the batch.
        let q: Vec<f32> = query_pos
            .iter()
            .flat_map(|&p| (0..heads * 8).map(move |i| rnd(p * heads * 8 + i + 9000)))
            .collect();
        let out = paged_attention(&g, &layer, &queries, &q, heads);
        for (i, &pos) in query_pos.iter().enumerate() {
            for h in 0..heads {
                let kvh = h / 2;
                let ks: Vec<Vec<f32>> = (0..n)
                    .map(|t| k[t * stride + kvh * 8..t * stride + kvh * 8 + 8].to_vec())
                    .collect();
                let vs: Vec<Vec<f32>> = (0..n)
                    .map(|t| v[t * stride + kvh * 8..t * stride + kvh * 8 + 8].to_vec())
                    .collect();
                let qh = &q[(i * heads + h) * 8..(i * heads + h + 1) * 8];
                let want = reference(qh, &ks, &vs, pos);
                let got = &out[(i * heads + h) * 8..(i * heads + h + 1) * 8];
                for (a, b) in want.iter().zip(got) {
                    assert!((a - b).abs() < 1e-5, "pos {pos} head {h}: {a} vs {b}");
                }
            }
        }
        out
    }

    /// The AVX2 dot is the portable one, bit for bit.
    #[test]
    fn dot_is_the_same_on_every_path() {
        let a: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) / 3.0)
            .collect();
        let b: Vec<f32> = (0..64)
            .map(|i| ((i * 53 % 31) as f32 - 15.0) / 7.0)
            .collect();
        let mut acc = [0f32; 8];
        for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
            for j in 0..8 {
                acc[j] += x[j] * y[j];
            }
        }
        let want =
            ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        assert_eq!(dot(&a, &b).to_bits(), want.to_bits());
    }

    /// Four keys at a time and values held in registers give the bits of
    /// one `dot` per key and one `axpy` per position (whole and partial
    /// groups of four; 64-column and 8-column register blocks).
    #[test]
    fn runs_are_dot_and_axpy_bit_for_bit() {
        let val = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 97.0;
        for hd in [8, 64, 72] {
            let (n, stride) = (7, hd + 24);
            let rows: Vec<f32> = (0..n * stride).map(val).collect();
            let q: Vec<f32> = (0..hd).map(|i| val(i + 40_000)).collect();
            let mut got = vec![0f32; n];
            scores_run(&q, &rows, stride, n, 0.125, &mut got);
            for (i, g) in got.iter().enumerate() {
                let want = dot(&q, &rows[i * stride..i * stride + hd]) * 0.125;
                assert_eq!(g.to_bits(), want.to_bits(), "hd {hd} key {i}");
            }
            let p: Vec<f32> = (0..n).map(|i| val(i + 90_000) / 7.0).collect();
            let mut want = q.clone();
            for (i, &pi) in p.iter().enumerate() {
                axpy(&mut want, pi, &rows[i * stride..i * stride + hd]);
            }
            let mut got = q.clone();
            values_run(&mut got, &p, &rows, stride, n);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "hd {hd}");
        }
    }

    #[test]
    fn the_vectorised_exp_is_within_two_ulp_of_std() {
        let mut worst = 0u32;
        let mut x = 0f32;
        while x > -87.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max(a.to_bits().abs_diff(b.to_bits()));
            x -= 0.000_37;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan(), "a NaN score stays NaN");
        assert!(exp(-1e30) > 0.0 && exp(-1e30) < 1.3e-38);
        let mut row = [0.5f32, -3.0, 2.0, 1.0, 0.0, -1.0, 2.0, -7.5, 0.25, 1.5];
        assert_eq!(max_of(&row), 2.0);
        let want: f32 = row.iter().map(|v| (v - 2.0).exp()).sum();
        let got = exp_and_sum(&mut row, 2.0);
        assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
        assert!((row[1] - (-5.0f32).exp()).abs() < 1e-9);
    }

    #[test]
    fn paged_matches_dense_with_scattered_blocks_and_gqa() {
        check(4, 10, &(0..10).collect::<Vec<_>>());
    }

    /// Tokens past the first share: their positions are split into shares
    /// (block boundaries inside shares, a short last share) and merged.
    #[test]
    fn a_split_decode_matches_dense() {
        let n = 3 * SHARE + 7;
        let alone = check(16, n, &[n - 1]);
        let batched = check(16, n, &[3, n - 1, SHARE + 1]);
        // Bit for bit the same with other tokens in the step.
        let w = alone.len();
        assert_eq!(alone, batched[w..2 * w]);
        let short = check(16, n, &[3]);
        assert_eq!(short, batched[..w]);
        // A prefill of every position: tasks enough for the threads, so
        // each runs its shares in turn; the same bits as each token alone.
        let all = check(16, n, &(0..n).collect::<Vec<_>>());
        for p in [3, SHARE - 1, SHARE, SHARE + 1, n - 1] {
            assert_eq!(
                all[p * w..(p + 1) * w],
                check(16, n, &[p])[..],
                "position {p}"
            );
        }
    }
}
