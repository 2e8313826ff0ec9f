//! `kernels/paged_attention.cu`'s split decode, replayed on the CPU: each
//! block of a (head, sequence, partition) walks its keys with four warps'
//! online softmaxes, merges them, and writes (max, sum, accumulator); the
//! merge kernel combines the records, skipping empty ones. The result must be
//! the attention of `reference::paged_attention` for any partition size, with
//! partitions past a context (empty) and a sequence with no keys at all. No
//! GPU runs this; the GPU self-test runs the kernels themselves.

use envelope_cuda::geometry::{decode_partials_len, flatten_block_tables};
use envelope_cuda::reference::{paged_attention, AttnShape};

const WARPS: usize = 4;

/// One block of `paged_attention_decode`: keys `t0..t1` of (seq, head).
/// Returns (max, sum, unnormalised accumulator), as the kernel's record.
#[allow(clippy::too_many_arguments)]
fn block(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    table: &[i32],
    sh: AttnShape,
    seq: usize,
    head: usize,
    t0: usize,
    t1: usize,
) -> (f32, f32, Vec<f32>) {
    let hd = sh.head_dim;
    let kvh = head / (sh.num_heads / sh.num_kv_heads);
    let stride = sh.num_kv_heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let qh = &q[(seq * sh.num_heads + head) * hd..][..hd];
    let mut warps = Vec::new();
    for w in 0..WARPS {
        let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
        let mut t = t0 + w;
        while t < t1 {
            let off = (table[t / sh.block_size] as usize * sh.block_size + t % sh.block_size)
                * stride
                + kvh * hd;
            let s = qh
                .iter()
                .zip(&kc[off..off + hd])
                .map(|(a, b)| a * b)
                .sum::<f32>()
                * scale;
            let m_new = m.max(s);
            let (corr, p) = ((m - m_new).exp(), (s - m_new).exp());
            l = l * corr + p;
            for (a, v) in acc.iter_mut().zip(&vc[off..off + hd]) {
                *a = *a * corr + p * v;
            }
            m = m_new;
            t += WARPS;
        }
        warps.push((m, l, acc));
    }
    merge(&warps, hd)
}

/// The kernels' merge of (max, sum, accumulator) triples: records with sum
/// 0 are skipped; returns the combined (max, sum, accumulator).
fn merge(recs: &[(f32, f32, Vec<f32>)], hd: usize) -> (f32, f32, Vec<f32>) {
    let live = || recs.iter().filter(|r| r.1 > 0.0);
    let gm = live().fold(f32::NEG_INFINITY, |a, r| a.max(r.0));
    let gl: f32 = live().map(|r| r.1 * (r.0 - gm).exp()).sum();
    let mut o = vec![0f32; hd];
    for r in live() {
        for (od, a) in o.iter_mut().zip(&r.2) {
            *od += a * (r.0 - gm).exp();
        }
    }
    (gm, gl, o)
}

/// The split decode: partition records in the partials layout, then the
/// merge kernel, per (seq, head).
fn split_decode(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    tables: &[i32],
    ctx: &[i32],
    sh: AttnShape,
    part_size: usize,
) -> Vec<f32> {
    let hd = sh.head_dim;
    let parts = (sh.max_blocks_per_seq * sh.block_size).div_ceil(part_size);
    let mut partials = vec![f32::NAN; decode_partials_len(ctx.len(), sh.num_heads, hd, parts)];
    for seq in 0..ctx.len() {
        let table = &tables[seq * sh.max_blocks_per_seq..][..sh.max_blocks_per_seq];
        let n = ctx[seq] as usize;
        for head in 0..sh.num_heads {
            for p in 0..parts {
                let t0 = p * part_size;
                let (m, l, acc) = block(q, kc, vc, table, sh, seq, head, t0, n.min(t0 + part_size));
                let rec =
                    &mut partials[((seq * sh.num_heads + head) * parts + p) * (hd + 2)..][..hd + 2];
                rec[0] = m;
                rec[1] = l;
                rec[2..].copy_from_slice(&acc);
            }
        }
    }
    let mut out = vec![f32::NAN; ctx.len() * sh.num_heads * hd];
    for seq in 0..ctx.len() {
        for head in 0..sh.num_heads {
            let recs: Vec<(f32, f32, Vec<f32>)> = (0..parts)
                .map(|p| {
                    let r =
                        &partials[((seq * sh.num_heads + head) * parts + p) * (hd + 2)..][..hd + 2];
                    (r[0], r[1], r[2..].to_vec())
                })
                .collect();
            let (_, gl, o) = merge(&recs, hd);
            for (d, od) in o.iter().enumerate() {
                out[(seq * sh.num_heads + head) * hd + d] = if gl > 0.0 { od / gl } else { 0.0 };
            }
        }
    }
    out
}

/// A small deterministic generator (xorshift), values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[test]
fn split_decode_equals_attention_for_any_partition_size() {
    let (heads, kv_heads, hd, bs) = (4, 2, 32, 16);
    // 300 keys (5 partitions of 64), 37, 1 and none (a padding row).
    let ctx: Vec<usize> = vec![300, 37, 1, 0];
    let mut next = 0u32;
    let tables: Vec<Vec<u32>> = ctx
        .iter()
        .map(|&n| {
            // Blocks in reverse order, so a wrong table lookup shows.
            let t: Vec<u32> = (next..next + n.div_ceil(bs) as u32).rev().collect();
            next += t.len() as u32;
            t
        })
        .collect();
    let refs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
    let flat = flatten_block_tables(&refs, &ctx, bs).unwrap();
    let sh = AttnShape {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        block_size: bs,
        max_blocks_per_seq: flat.max_blocks_per_seq,
    };
    let cache = next as usize * bs * kv_heads * hd;
    // Scaled up so the softmax is peaked and a wrong rescale shows.
    let kc: Vec<f32> = values(cache, 1).iter().map(|x| 4.0 * x).collect();
    let vc = values(cache, 2);
    let q = values(ctx.len() * heads * hd, 3);
    let ctx_i: Vec<i32> = ctx.iter().map(|&n| n as i32).collect();
    let cu: Vec<i32> = (0..=ctx.len() as i32).collect();
    let want = paged_attention(&q, &kc, &vc, &flat.data, &cu, &ctx_i, sh);
    for part_size in [512, 300, 64, 7, 1] {
        let got = split_decode(&q, &kc, &vc, &flat.data, &ctx_i, sh, part_size);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5,
                "partitions of {part_size}: element {i}: {g} vs {w}"
            );
        }
    }
}
