//! A paged cache with scattered blocks, filled through the runtime's
//! `kv_append` (checked against the reference), then read by decode
//! attention (as the engine calls it, and split into partitions and
//! merged) and by prefill attention, for every activation/cache dtype pair.

use super::check::{round, Cx};
use crate::geometry;
use crate::reference as r;
use crate::runtime::{le_bytes, AttnDims, Buf, DType};

pub(super) fn cases(cx: &mut Cx) {
    for (act, cache) in [
        (DType::F32, DType::F32),
        (DType::F32, DType::F16),
        (DType::F32, DType::Bf16),
        (DType::F16, DType::F16),
        (DType::Bf16, DType::Bf16),
    ] {
        for hd in [64, 128] {
            paged(cx, act, cache, hd);
        }
    }
}

/// The cache both attention kernels read, on the device and on the host.
struct Cache {
    k: Buf,
    v: Buf,
    k_ref: Vec<f32>,
    v_ref: Vec<f32>,
}

fn paged(cx: &mut Cx, act: DType, cache: DType, hd: usize) {
    let (heads, kv_heads, bs) = (8, 2, 16);
    let stride = kv_heads * hd;
    let ctx: Vec<usize> = vec![1, 37, 300];
    let q_lens: Vec<usize> = vec![1, 37, 45]; // the third: a chunk after 255 cached tokens
    let num_blocks = 40;
    let perm = cx.rng.perm(num_blocks);
    let mut used = 0;
    let tables: Vec<Vec<u32>> = ctx
        .iter()
        .map(|&n| {
            let t = perm[used..used + n.div_ceil(bs)].to_vec();
            used += t.len();
            t
        })
        .collect();
    // All tokens of all sequences, appended in one kv_append call.
    let mut slots = Vec::new();
    for (t, &n) in tables.iter().zip(&ctx) {
        slots.extend(geometry::slot_mapping(t, 0..n, bs).expect("tables cover ctx"));
    }
    slots.push(-1); // a padding token that must be skipped
    let ntok = slots.len();
    let k = round(act, &cx.rng.vec(ntok * stride, 1.0));
    let v = round(act, &cx.rng.vec(ntok * stride, 1.0));
    let cache_elems = num_blocks * bs * stride;
    let (mut kc, mut vc) = (vec![0f32; cache_elems], vec![0f32; cache_elems]);
    r::kv_append(&k, &v, &mut kc, &mut vc, &slots, stride);
    let (kc, vc) = (round(cache, &kc), round(cache, &vc));
    let entry = format!("kv_append_{}_{}", act.suffix(), cache.suffix());
    let g = cx.gpu;
    let gpu_cache = (|| {
        let (kb, vb) = (g.upload_f32(act, &k)?, g.upload_f32(act, &v)?);
        let sb = g.upload(DType::I64, &le_bytes(&slots, i64::to_le_bytes))?;
        let (kcb, vcb) = (g.zeros(cache, cache_elems)?, g.zeros(cache, cache_elems)?);
        g.kv_append(&kb, &vb, &kcb, &vcb, &sb, ntok, kv_heads, hd)?;
        Ok((kcb, vcb))
    })();
    let (kcb, vcb) = match gpu_cache {
        Ok(c) => c,
        Err(e) => {
            cx.check("kv_append", &entry, cache, Err(e), &kc, None);
            return;
        }
    };
    let got = g.download(&kcb);
    cx.check(
        &format!("kv_append {ntok} tokens hd {hd}"),
        &entry,
        cache,
        got,
        &kc,
        None,
    );
    let refs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
    let flat = geometry::flatten_block_tables(&refs, &ctx, bs).expect("valid tables");
    let dims = AttnDims {
        num_seqs: ctx.len(),
        heads,
        kv_heads,
        head_dim: hd,
        block_size: bs,
        max_blocks_per_seq: flat.max_blocks_per_seq,
    };
    let cache = Cache {
        k: kcb,
        v: vcb,
        k_ref: kc,
        v_ref: vc,
    };
    let ctx_i: Vec<i32> = ctx.iter().map(|&n| n as i32).collect();
    decode(cx, act, &cache, &flat.data, &ctx_i, dims);
    prefill(cx, act, &cache, &flat.data, &ctx_i, &q_lens, dims);
}

/// The reference's shape of an attention call.
fn shape(a: AttnDims) -> r::AttnShape {
    r::AttnShape {
        num_heads: a.heads,
        num_kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        block_size: a.block_size,
        max_blocks_per_seq: a.max_blocks_per_seq,
    }
}

/// The attention output is rounded to `act`; compare at the coarser of the
/// activation and cache dtypes.
fn tol_dtype(act: DType, cache: DType) -> DType {
    if act == DType::Bf16 || cache == DType::Bf16 {
        DType::Bf16
    } else if act == DType::F16 || cache == DType::F16 {
        DType::F16
    } else {
        DType::F32
    }
}

/// Decode: one query per sequence (its last position).
fn decode(cx: &mut Cx, act: DType, c: &Cache, tables: &[i32], ctx: &[i32], a: AttnDims) {
    let cache = c.k.dtype;
    let q = round(act, &cx.rng.vec(a.num_seqs * a.heads * a.head_dim, 1.0));
    let cu1 = geometry::cu_seqlens(&vec![1; a.num_seqs]);
    let want = round(
        act,
        &r::paged_attention(&q, &c.k_ref, &c.v_ref, tables, &cu1, ctx, shape(a)),
    );
    let entry = format!("paged_attention_decode_{}_{}", act.suffix(), cache.suffix());
    let width = a.max_blocks_per_seq * a.block_size;
    // As the engine calls it (unsplit at this table width), then split into
    // partitions of 64 keys and merged: the 300-key sequence spans 5, the
    // shorter ones leave partitions past their context empty.
    for split in [None, Some(64)] {
        let (parts, part_keys) = match split {
            None => (
                geometry::decode_partitions(
                    a.num_seqs,
                    a.heads,
                    a.max_blocks_per_seq,
                    a.block_size,
                ),
                geometry::DECODE_PARTITION,
            ),
            Some(p) => (width.div_ceil(p).max(1), p),
        };
        let g = cx.gpu;
        let got = (|| {
            let (qb, o) = (g.upload_f32(act, &q)?, g.zeros(act, q.len())?);
            let bt = g.upload(DType::I32, &le_bytes(tables, i32::to_le_bytes))?;
            let cl = g.upload(DType::I32, &le_bytes(ctx, i32::to_le_bytes))?;
            match split {
                None => g.paged_decode(&o, &qb, &c.k, &c.v, &bt, &cl, a)?,
                Some(p) => g.paged_decode_split(&o, &qb, &c.k, &c.v, &bt, &cl, a, p)?,
            }
            g.download(&o)
        })();
        cx.check(
            &format!(
                "decode attention ctx {ctx:?} hd {} gqa {}/{}{}",
                a.head_dim,
                a.heads,
                a.kv_heads,
                if parts > 1 {
                    format!(", {parts} partitions of {part_keys} keys")
                } else {
                    String::new()
                }
            ),
            &entry,
            tol_dtype(act, cache),
            got,
            &want,
            None,
        );
    }
}

/// Prefill: whole prompts and a chunk after cached context.
fn prefill(
    cx: &mut Cx,
    act: DType,
    c: &Cache,
    tables: &[i32],
    ctx: &[i32],
    q_lens: &[usize],
    a: AttnDims,
) {
    let cache = c.k.dtype;
    let total_q: usize = q_lens.iter().sum();
    let q = round(act, &cx.rng.vec(total_q * a.heads * a.head_dim, 1.0));
    let cu = geometry::cu_seqlens(q_lens);
    let want = round(
        act,
        &r::paged_attention(&q, &c.k_ref, &c.v_ref, tables, &cu, ctx, shape(a)),
    );
    let entry = format!("prefill_attention_{}_{}", act.suffix(), cache.suffix());
    let g = cx.gpu;
    let got = (|| {
        let (qb, o) = (g.upload_f32(act, &q)?, g.zeros(act, q.len())?);
        let bt = g.upload(DType::I32, &le_bytes(tables, i32::to_le_bytes))?;
        let cl = g.upload(DType::I32, &le_bytes(ctx, i32::to_le_bytes))?;
        let cub = g.upload(DType::I32, &le_bytes(&cu, i32::to_le_bytes))?;
        let max_q = *q_lens.iter().max().unwrap_or(&1);
        g.prefill(&o, &qb, &c.k, &c.v, &bt, &cub, &cl, max_q, a)?;
        g.download(&o)
    })();
    cx.check(
        &format!(
            "prefill attention q {q_lens:?} ctx {ctx:?} hd {}",
            a.head_dim
        ),
        &entry,
        tol_dtype(act, cache),
        got,
        &want,
        None,
    );
}
