//! CPU reference implementations of every kernel in `kernels/`, written for
//! clarity, not speed, with the same conventions as the kernels (and, where
//! the engine has the operation, as `envelope-engine`'s CPU code). The GPU
//! self-test compares each kernel against these; the unit tests below check
//! the references themselves. mistral.rs's `*_reference` functions are the
//! model for this.

/// `out[t] = table[ids[t]]`, rows of `hidden`.
pub fn embedding(ids: &[u32], table: &[f32], hidden: usize) -> Vec<f32> {
    ids.iter()
        .flat_map(|&i| {
            table[i as usize * hidden..(i as usize + 1) * hidden]
                .iter()
                .copied()
        })
        .collect()
}

/// `x / sqrt(mean(x^2) + eps) * w` per row (candle's rms_norm).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    x.chunks(h)
        .flat_map(|row| {
            let ss: f32 = row.iter().map(|v| v * v).sum();
            let m = (ss / h as f32 + eps).sqrt();
            row.iter().zip(w).map(move |(v, g)| v / m * g)
        })
        .collect()
}

/// `1 / theta^(2i / head_dim)` for i < head_dim / 2, as the CPU engine computes it.
pub fn inv_freq(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / theta.powf(i as f32 / head_dim as f32))
        .collect()
}

/// RoPE in place on `[tokens, heads, head_dim]` (see `kernels/rope.cu`).
pub fn rope(x: &mut [f32], positions: &[u32], inv_freq: &[f32], heads: usize, interleaved: bool) {
    let half = inv_freq.len();
    let hd = 2 * half;
    for (t, tok) in x.chunks_mut(heads * hd).enumerate() {
        for head in tok.chunks_mut(hd) {
            for (i, f) in inv_freq.iter().enumerate() {
                let a = positions[t] as f32 * f;
                let (c, s) = (a.cos(), a.sin());
                let (i0, i1) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x0, x1) = (head[i0], head[i1]);
                head[i0] = x0 * c - x1 * s;
                head[i1] = x0 * s + x1 * c;
            }
        }
    }
}

pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect()
}

pub fn residual_add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Writes token rows of `stride` elements into flat cache slots (negative: skip).
pub fn kv_append(
    k: &[f32],
    v: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    slots: &[i64],
    stride: usize,
) {
    for (t, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let d = s as usize * stride;
        k_cache[d..d + stride].copy_from_slice(&k[t * stride..(t + 1) * stride]);
        v_cache[d..d + stride].copy_from_slice(&v[t * stride..(t + 1) * stride]);
    }
}

/// Shape of a paged attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
}

/// Causal attention through block tables, the semantics of both
/// `paged_attention_decode` (every q_len 1) and `prefill_attention`:
/// sequence s has query rows `cu_q[s]..cu_q[s+1]` at positions
/// `ctx[s] - q_len + i`, and keys `0..=position` from the cache
/// `[block][slot][kv_head][head_dim]`. Dense softmax per row.
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_tables: &[i32],
    cu_q: &[i32],
    ctx: &[i32],
    sh: AttnShape,
) -> Vec<f32> {
    let hd = sh.head_dim;
    let group = sh.num_heads / sh.num_kv_heads;
    let stride = sh.num_kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    for s in 0..ctx.len() {
        let (q0, q1) = (cu_q[s] as usize, cu_q[s + 1] as usize);
        let n = ctx[s] as usize;
        if n == 0 {
            continue; // a padding row: zeros, as the kernels write
        }
        let table = &block_tables[s * sh.max_blocks_per_seq..(s + 1) * sh.max_blocks_per_seq];
        for (i, row) in (q0..q1).enumerate() {
            let pos = n - (q1 - q0) + i;
            for h in 0..sh.num_heads {
                let kvh = h / group;
                let qh = &q[(row * sh.num_heads + h) * hd..][..hd];
                let off = |t: usize| {
                    (table[t / sh.block_size] as usize * sh.block_size + t % sh.block_size) * stride
                        + kvh * hd
                };
                let scores: Vec<f32> = (0..=pos)
                    .map(|t| {
                        qh.iter()
                            .zip(&k_cache[off(t)..off(t) + hd])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            * scale
                    })
                    .collect();
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                let o = &mut out[(row * sh.num_heads + h) * hd..][..hd];
                for (t, p) in e.iter().enumerate() {
                    for (od, vd) in o.iter_mut().zip(&v_cache[off(t)..off(t) + hd]) {
                        *od += p / z * vd;
                    }
                }
            }
        }
    }
    out
}

/// splitmix64, the hash of the dummy weights (kernels/dummy.cu).
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `dummy_fill`: element i is `splitmix64(key ^ i)` mapped to a uniform in
/// [-scale, scale), rounded to bf16 (then exact in f32, f16 or bf16 output
/// up to that dtype's own rounding).
pub fn dummy_fill(key: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let unit = (splitmix64(key ^ i) >> 40) as f32 / (1u64 << 24) as f32;
            half::bf16::from_f32((unit * 2.0 - 1.0) * scale).to_f32()
        })
        .collect()
}

/// `quant_fp8`: e4m3 bytes of `x / s` with `s = max(max |x|, 1e-12) / 448`,
/// and `s`.
pub fn quant_fp8(x: &[f32]) -> (Vec<u8>, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s = amax.max(1e-12) / 448.0;
    (x.iter().map(|v| crate::fp8::encode(v / s)).collect(), s)
}

/// `bias_add`: `x[r, i] + b[i]`.
pub fn bias_add(x: &[f32], b: &[f32]) -> Vec<f32> {
    x.chunks(b.len())
        .flat_map(|row| row.iter().zip(b).map(|(v, c)| v + c))
        .collect()
}

/// `gemm.cu`: `y[rows, out] = scale * x[rows, inner] W[out, inner]^T`, plus
/// `y0` when given (the fused residual add), summed in f64.
pub fn gemm_tn(
    x: &[f32],
    w: &[f32],
    y0: Option<&[f32]>,
    (rows, inner, out): (usize, usize, usize),
    scale: f32,
) -> Vec<f32> {
    let mut y = vec![0f32; rows * out];
    for r in 0..rows {
        let xr = &x[r * inner..(r + 1) * inner];
        for c in 0..out {
            let wc = &w[c * inner..(c + 1) * inner];
            let dot: f64 = xr.iter().zip(wc).map(|(a, b)| *a as f64 * *b as f64).sum();
            let base = y0.map_or(0.0, |y0| y0[r * out + c]);
            y[r * out + c] = (dot * scale as f64) as f32 + base;
        }
    }
    y
}

fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// GGUF Q4_0 blocks (18 bytes) to f32, as `envelope-engine`'s qgemm reads them.
pub fn dequant_q4_0(blocks: &[u8]) -> Vec<f32> {
    blocks
        .chunks_exact(18)
        .flat_map(|b| {
            let d = f16_at(b);
            (0..32).map(move |i| {
                let q = if i < 16 {
                    b[2 + i] & 0x0F
                } else {
                    b[2 + i - 16] >> 4
                };
                q as f32 * d + (-8.0 * d)
            })
        })
        .collect()
}

/// GGUF Q4_1 blocks (20 bytes: d, m, 16 bytes of nibbles).
pub fn dequant_q4_1(blocks: &[u8]) -> Vec<f32> {
    blocks
        .chunks_exact(20)
        .flat_map(|b| {
            let (d, m) = (f16_at(b), f16_at(&b[2..]));
            (0..32).map(move |i| {
                let q = if i < 16 {
                    b[4 + i] & 0x0F
                } else {
                    b[4 + i - 16] >> 4
                };
                q as f32 * d + m
            })
        })
        .collect()
}

/// GGUF Q8_0 blocks (34 bytes: d, 32 x i8).
pub fn dequant_q8_0(blocks: &[u8]) -> Vec<f32> {
    blocks
        .chunks_exact(34)
        .flat_map(|b| {
            let d = f16_at(b);
            (0..32).map(move |i| b[2 + i] as i8 as f32 * d)
        })
        .collect()
}

/// The largest logit's index; the lowest index on a tie. NaNs are passed
/// over, except a NaN first logit, which wins (as a scan that keeps the
/// first value nothing is greater than would have it). Two passes, the
/// maximum in 16 independent lanes (vectorised), then its first index:
/// over a 49152-logit vocabulary per sequence, the one-pass scan's
/// dependent compare was 2% of a 16-sequence CPU decode step.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    if logits.first().is_none_or(|v| v.is_nan()) {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = m.max(*v);
        }
    }
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, v| a.max(*v));
    logits.iter().position(|v| *v == max).unwrap_or(0) as u32
}

/// Threads of `sampling.cu`, whose chunking this reference mirrors.
pub const SAMPLE_THREADS: usize = 256;

/// What `top_p_sample` decided, for comparisons with some slack.
#[derive(Debug, Clone)]
pub struct TopP {
    pub token: u32,
    /// Weights `e_i = exp((x_i - max) / T)` at or above this are kept.
    pub threshold: f32,
    pub weights: Vec<f32>,
}

/// `kernels/sampling.cu`'s top-p on the CPU: bisect the weight threshold
/// (32 steps; none when `top_p >= 1`) so the kept mass reaches `top_p`, then walk the kept tokens in
/// index order (chunked as the kernel's threads are) to `u * kept_mass`.
pub fn top_p_sample(logits: &[f32], temperature: f32, top_p: f32, u: f32) -> TopP {
    let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Multiply by the reciprocal, as the kernel does (not divide: the roundings differ).
    let inv_t = 1.0 / temperature;
    let w: Vec<f32> = logits.iter().map(|x| ((x - mx) * inv_t).exp()).collect();
    let z: f32 = w.iter().sum();
    let need = top_p * z;
    let (mut lo, mut hi) = (0f32, 1f32);
    // top_p >= 1 keeps every token: no bisection (as the kernel).
    let steps = if top_p < 1.0 { 32 } else { 0 };
    for _ in 0..steps {
        let mid = 0.5 * (lo + hi);
        let s: f32 = w.iter().filter(|&&e| e >= mid).sum();
        if s >= need {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let chunk = logits.len().div_ceil(SAMPLE_THREADS);
    let sums: Vec<f32> = w
        .chunks(chunk)
        .map(|c| c.iter().filter(|&&e| e >= lo).sum())
        .collect();
    let kept: f32 = sums.iter().sum();
    let last = w.iter().rposition(|&e| e >= lo && e > 0.0).unwrap_or(0);
    let target = u * kept;
    let mut cum = 0f32;
    let mut token = None;
    'outer: for (c, s) in sums.iter().enumerate() {
        if *s <= 0.0 {
            continue;
        }
        if cum + s <= target {
            cum += s;
            continue;
        }
        for (i, &e) in w.iter().enumerate().skip(c * chunk).take(chunk) {
            if e < lo {
                continue;
            }
            cum += e;
            if cum > target {
                token = Some(i);
                break 'outer;
            }
        }
    }
    TopP {
        token: token.unwrap_or(last) as u32,
        threshold: lo,
        weights: w,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn fp8_quantisation_scales_the_largest_value_to_448() {
        let x = [0.5f32, -2.0, 1.0, 0.0];
        let (q, s) = quant_fp8(&x);
        assert_eq!(s, 2.0 / 448.0);
        assert_eq!(crate::fp8::decode(q[1]), -448.0);
        let back: Vec<f32> = q.iter().map(|&b| crate::fp8::decode(b) * s).collect();
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-9, "{a} vs {b}");
        }
        // All zeros: a tiny scale, no NaN.
        let (q0, s0) = quant_fp8(&[0.0; 3]);
        assert!(s0 > 0.0 && q0.iter().all(|&b| crate::fp8::decode(b) == 0.0));
    }

    #[test]
    fn bias_is_added_per_column() {
        assert_eq!(
            bias_add(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0]),
            vec![11.0, 22.0, 13.0, 24.0]
        );
    }

    #[test]
    fn dummy_fill_is_bf16_and_bounded() {
        let v = dummy_fill(42, 10_000, 0.5);
        assert!(v.iter().all(|x| (-0.5..=0.5).contains(x)));
        assert!(v.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x));
        assert_ne!(v, dummy_fill(43, 10_000, 0.5));
    }

    use super::*;

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol, "{x} vs {y}");
        }
    }

    #[test]
    fn embedding_gathers_rows() {
        let table = [0., 1., 10., 11., 20., 21.];
        assert_eq!(
            embedding(&[2, 0, 2], &table, 2),
            vec![20., 21., 0., 1., 20., 21.]
        );
    }

    #[test]
    fn rmsnorm_of_a_constant_row_is_the_weight() {
        let out = rmsnorm(&[3.0; 4], &[1., 2., 3., 4.], 0.0);
        close(&out, &[1., 2., 3., 4.], 1e-6);
        // mean(x^2) = 25/2 for [3, 4]: each divided by sqrt(12.5).
        let out = rmsnorm(&[3., 4.], &[1., 1.], 0.0);
        close(&out, &[3. / 12.5f32.sqrt(), 4. / 12.5f32.sqrt()], 1e-6);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_keeps_norms() {
        let f = inv_freq(10_000.0, 8);
        assert_eq!(f[0], 1.0);
        let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.5).collect();
        for il in [false, true] {
            let mut x = x0.clone();
            rope(&mut x, &[0], &f, 2, il);
            close(&x, &x0, 0.0);
            let mut x = x0.clone();
            rope(&mut x, &[17], &f, 2, il);
            let n0: f32 = x0.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
        }
    }

    #[test]
    fn rope_styles_differ_only_by_the_pairing() {
        // Interleaved on [a0 b0 a1 b1] equals half-split on [a0 a1 b0 b1].
        let f = inv_freq(500.0, 4);
        let mut il = vec![1., 2., 3., 4.];
        rope(&mut il, &[5], &f, 1, true);
        let mut hs = vec![1., 3., 2., 4.];
        rope(&mut hs, &[5], &f, 1, false);
        close(&il, &[hs[0], hs[2], hs[1], hs[3]], 1e-6);
    }

    #[test]
    fn silu_and_residual() {
        close(
            &silu_mul(&[0.0, 1.0], &[5.0, 2.0]),
            &[0.0, 2.0 / (1.0 + (-1f32).exp())],
            1e-6,
        );
        assert_eq!(residual_add(&[1., 2.], &[3., 4.]), vec![4., 6.]);
    }

    #[test]
    fn kv_append_writes_slots() {
        let (mut kc, mut vc) = (vec![0f32; 8], vec![0f32; 8]);
        kv_append(
            &[1., 2., 3., 4.],
            &[5., 6., 7., 8.],
            &mut kc,
            &mut vc,
            &[3, -1],
            2,
        );
        assert_eq!(kc, vec![0., 0., 0., 0., 0., 0., 1., 2.]);
        assert_eq!(vc[6..], [5., 6.]);
    }

    #[test]
    fn attention_over_one_key_returns_its_value_and_equal_keys_average() {
        let sh = AttnShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 2,
            max_blocks_per_seq: 2,
        };
        // Cache of 3 blocks; the sequence uses blocks [2, 0]: positions 0,1 in
        // block 2, position 2 in block 0.
        let mut kc = vec![0f32; 12];
        let mut vc = vec![0f32; 12];
        for (pos, slot) in [(0usize, 4usize), (1, 5), (2, 0)] {
            kc[slot * 2..slot * 2 + 2].copy_from_slice(&[1.0, 1.0]);
            vc[slot * 2..slot * 2 + 2].copy_from_slice(&[pos as f32, 10.0 * pos as f32]);
        }
        let q = vec![0.3f32; 3 * 2 * 2]; // 3 query rows (prefill of the whole sequence)
        let out = paged_attention(&q, &kc, &vc, &[2, 0], &[0, 3], &[3], sh);
        // Row 0 sees only position 0; row 2 sees all three equal keys: the mean.
        close(&out[0..2], &[0.0, 0.0], 1e-6);
        close(&out[8..10], &[1.0, 10.0], 1e-5);
        // Decode of the last token alone gives the same as the prefill's last row.
        let dec = paged_attention(&q[8..12], &kc, &vc, &[2, 0], &[0, 1], &[3], sh);
        close(&dec, &out[8..12], 1e-6);
    }

    #[test]
    fn dequant_blocks() {
        let d = half::f16::from_f32(0.5).to_le_bytes();
        let m = half::f16::from_f32(-1.0).to_le_bytes();
        let mut q40 = vec![d[0], d[1]];
        q40.extend([0x1Fu8; 16]); // lo 15, hi 1
        let w = dequant_q4_0(&q40);
        assert_eq!(w[0], (15.0 - 8.0) * 0.5);
        assert_eq!(w[16], (1.0 - 8.0) * 0.5);
        let mut q41 = vec![d[0], d[1], m[0], m[1]];
        q41.extend([0x1Fu8; 16]);
        let w = dequant_q4_1(&q41);
        assert_eq!((w[0], w[31]), (15.0 * 0.5 - 1.0, 0.5 - 1.0));
        let mut q8 = vec![d[0], d[1]];
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let w = dequant_q8_0(&q8);
        assert_eq!((w[0], w[31]), (-8.0, 7.5));
    }

    #[test]
    fn argmax_lowest_index_wins_ties() {
        assert_eq!(argmax(&[1., 3., 3., 2.]), 1);
        // The one-pass scan it replaced, on long rows with ties, NaNs and
        // signed zeros in every lane position.
        let scan = |xs: &[f32]| {
            let mut best = 0;
            for (i, &v) in xs.iter().enumerate() {
                if v > xs[best] {
                    best = i;
                }
            }
            best as u32
        };
        for n in [0, 1, 15, 16, 17, 100, 1000] {
            for seed in 0..20u32 {
                let xs: Vec<f32> = (0..n as u32)
                    .map(
                        |i| match (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 23 {
                            0 => f32::NAN,
                            1 => -0.0,
                            2 => 0.0,
                            k => (k % 7) as f32 - 3.0,
                        },
                    )
                    .collect();
                assert_eq!(argmax(&xs), scan(&xs), "{xs:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Distinct values (on a tie at the threshold every tied token is kept).
        let logits: Vec<f32> = (0..1000)
            .map(|i| (i as f32 * 0.7).sin() * 3.0 + i as f32 * 1e-4)
            .collect();
        // A tiny top_p keeps only the best token, whatever u is.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(top_p_sample(&logits, 1.0, 1e-6, u).token, argmax(&logits));
        }
        // top_p = 1 keeps everything: u walks the whole distribution in order.
        let r = top_p_sample(&logits, 1.0, 1.0, 0.0);
        assert_eq!(r.token, 0);
        let r = top_p_sample(&logits, 1.0, 1.0, 0.999_999);
        assert!(r.token >= 990);
        // The kept mass is at least top_p and minimal up to the threshold's ties.
        let r = top_p_sample(&logits, 0.7, 0.9, 0.3);
        let z: f32 = r.weights.iter().sum();
        let kept: f32 = r.weights.iter().filter(|&&e| e >= r.threshold).sum();
        assert!(kept >= 0.9 * z * 0.9999);
        assert!(r.weights[r.token as usize] >= r.threshold);
    }

    /// With every token kept (top_p 1) and u at the top of [0, 1), the walk
    /// can end short of the target by rounding; the fallback must still be
    /// a token with weight, not a trailing -inf (padding) logit.
    #[test]
    fn top_p_fallback_has_weight() {
        let mut logits: Vec<f32> = (0..49_152)
            .map(|i| ((i * 37 % 101) as f32) * 0.05)
            .collect();
        let n = logits.len();
        logits[n - 8..].fill(f32::NEG_INFINITY);
        for k in 1..64 {
            let u = 1.0 - k as f32 * f32::EPSILON / 2.0;
            let r = top_p_sample(&logits, 0.8, 1.0, u);
            assert!(
                r.weights[r.token as usize] > 0.0,
                "u {u}: token {}",
                r.token
            );
        }
    }

    #[test]
    fn gemm_tn_is_x_times_w_transposed() {
        // x = [[1, 2], [3, 4]], W = [[1, 0], [0, 1], [1, 1]] -> y = x W^T.
        let x = [1.0, 2.0, 3.0, 4.0];
        let w = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        assert_eq!(
            gemm_tn(&x, &w, None, (2, 2, 3), 1.0),
            vec![1.0, 2.0, 3.0, 3.0, 4.0, 7.0]
        );
        let y0 = [10.0; 6];
        assert_eq!(
            gemm_tn(&x, &w, Some(&y0), (2, 2, 3), 0.5),
            vec![10.5, 11.0, 11.5, 11.5, 12.0, 13.5]
        );
    }
}
