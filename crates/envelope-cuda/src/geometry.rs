//! Host-side bookkeeping for launches, as plain functions with unit tests:
//! grid and block per kernel by shape (matching the `.cu` files' comments),
//! block tables flattened for paged attention, slot mappings for the KV
//! append (vLLM's `slot_mapping`), cumulative query lengths, and the
//! batch-size buckets CUDA graphs are captured for.

use crate::error::{CudaError, Result};

/// One launch: grid and block dimensions and dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl Launch {
    pub fn to_cudarc(self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: self.grid,
            block_dim: self.block,
            shared_mem_bytes: self.shared_bytes,
        }
    }
}

/// Threads per block of the elementwise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// Threads per block of `sampling.cu` (`SAMPLE_THREADS`).
pub const SAMPLE_THREADS: u32 = 256;
/// Warps of the attention kernels (`PA_WARPS`, `PF_WARPS`).
pub const ATTENTION_THREADS: u32 = 128;
/// Query rows per prefill block (`PF_BQ`).
pub const PREFILL_QUERY_TILE: usize = 16;
/// Largest head_dim the attention kernels hold in registers (`PA_MAX_HD`).
pub const MAX_HEAD_DIM: usize = 256;

const MAX_GRID_X: usize = i32::MAX as usize;
const MAX_GRID_YZ: usize = 65_535;

fn shape(kernel: &'static str, reason: String) -> CudaError {
    CudaError::Shape { kernel, reason }
}

fn dim_x(kernel: &'static str, n: usize) -> Result<u32> {
    if n == 0 || n > MAX_GRID_X {
        return Err(shape(
            kernel,
            format!("grid.x = {n} is outside 1..={MAX_GRID_X}"),
        ));
    }
    Ok(n as u32)
}

fn dim_yz(kernel: &'static str, what: &str, n: usize) -> Result<u32> {
    if n == 0 || n > MAX_GRID_YZ {
        return Err(shape(
            kernel,
            format!("{what} = {n} is outside 1..={MAX_GRID_YZ}"),
        ));
    }
    Ok(n as u32)
}

/// One thread per element (silu_mul, residual_add, rope pairs, dequant).
pub fn elementwise(kernel: &'static str, n: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (
            dim_x(kernel, n.div_ceil(ELEMENTWISE_THREADS as usize))?,
            1,
            1,
        ),
        block: (ELEMENTWISE_THREADS, 1, 1),
        shared_bytes: 0,
    })
}

/// Rows of `width` elements: one row per grid.x, the row split over grid.y.
fn row_split(kernel: &'static str, rows: usize, width: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (
            dim_x(kernel, rows)?,
            dim_yz(
                kernel,
                "row blocks",
                width.div_ceil(ELEMENTWISE_THREADS as usize),
            )?,
            1,
        ),
        block: (ELEMENTWISE_THREADS, 1, 1),
        shared_bytes: 0,
    })
}

pub fn embedding(n_tokens: usize, hidden: usize) -> Result<Launch> {
    row_split("embedding", n_tokens, hidden)
}

pub fn kv_append(n_tokens: usize, num_kv_heads: usize, head_dim: usize) -> Result<Launch> {
    row_split("kv_append", n_tokens, num_kv_heads * head_dim)
}

/// One block per row; threads: the row length rounded up to a warp, at
/// most 1024 (each thread then strides over the row).
pub fn rmsnorm(rows: usize, hidden: usize) -> Result<Launch> {
    if hidden == 0 {
        return Err(shape("rmsnorm", "hidden = 0".into()));
    }
    let threads = hidden.div_ceil(32).min(32) * 32;
    Ok(Launch {
        grid: (dim_x("rmsnorm", rows)?, 1, 1),
        block: (threads as u32, 1, 1),
        shared_bytes: 0,
    })
}

pub fn rope(n_tokens: usize, heads: usize, head_dim: usize) -> Result<Launch> {
    if !head_dim.is_multiple_of(2) {
        return Err(shape("rope", format!("head_dim {head_dim} is odd")));
    }
    elementwise("rope", n_tokens * heads * head_dim / 2)
}

fn check_heads(kernel: &'static str, heads: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(shape(
            kernel,
            format!("{heads} query heads are not a multiple of {kv_heads} KV heads"),
        ));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > MAX_HEAD_DIM {
        return Err(shape(
            kernel,
            format!("head_dim {head_dim} must be a multiple of 32, at most {MAX_HEAD_DIM}"),
        ));
    }
    Ok(())
}

/// Keys per partition when decode attention is split (vLLM's PagedAttention
/// V2 uses 512 too).
pub const DECODE_PARTITION: usize = 512;
/// Above this many (sequence, head) blocks decode attention is not split:
/// there is enough work to fill the GPU without it (vLLM's heuristic for
/// choosing V1 over V2, also in mistral.rs's paged attention).
pub const DECODE_SPLIT_MAX_BLOCKS: usize = 512;

/// Partitions of one (sequence, head) in decode attention: 1 (no split)
/// when the block tables hold at most [`DECODE_PARTITION`] keys or the step
/// already has more than [`DECODE_SPLIT_MAX_BLOCKS`] (sequence, head)
/// pairs; else one per [`DECODE_PARTITION`] keys of the table width. It
/// depends on the table width, not the contexts, so a CUDA graph captured
/// for a width class stays valid for every step of that class.
pub fn decode_partitions(
    num_seqs: usize,
    heads: usize,
    max_blocks_per_seq: usize,
    block_size: usize,
) -> usize {
    let parts = (max_blocks_per_seq * block_size)
        .div_ceil(DECODE_PARTITION)
        .max(1);
    if parts == 1 || num_seqs * heads > DECODE_SPLIT_MAX_BLOCKS {
        1
    } else {
        parts
    }
}

/// f32 elements of the split's partial records: (max, sum, accumulator)
/// per sequence, head and partition.
pub fn decode_partials_len(num_seqs: usize, heads: usize, head_dim: usize, parts: usize) -> usize {
    num_seqs * heads * parts * (head_dim + 2)
}

/// Grid (heads, sequences, partitions), four warps.
pub fn paged_decode(
    num_seqs: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    partitions: usize,
) -> Result<Launch> {
    check_heads("paged_attention_decode", heads, kv_heads, head_dim)?;
    Ok(Launch {
        grid: (
            dim_x("paged_attention_decode", heads)?,
            dim_yz("paged_attention_decode", "sequences", num_seqs)?,
            dim_yz("paged_attention_decode", "partitions", partitions)?,
        ),
        block: (ATTENTION_THREADS, 1, 1),
        shared_bytes: 0,
    })
}

/// The split's merge: grid (heads, sequences), four warps.
pub fn paged_merge(num_seqs: usize, heads: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (
            dim_x("paged_attention_merge", heads)?,
            dim_yz("paged_attention_merge", "sequences", num_seqs)?,
            1,
        ),
        block: (ATTENTION_THREADS, 1, 1),
        shared_bytes: 0,
    })
}

/// Grid (query tiles of the longest chunk, heads, sequences), four warps.
pub fn prefill(
    num_seqs: usize,
    max_q_len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Launch> {
    check_heads("prefill_attention", heads, kv_heads, head_dim)?;
    Ok(Launch {
        grid: (
            dim_x("prefill_attention", max_q_len.div_ceil(PREFILL_QUERY_TILE))?,
            dim_yz("prefill_attention", "heads", heads)?,
            dim_yz("prefill_attention", "sequences", num_seqs)?,
        ),
        block: (ATTENTION_THREADS, 1, 1),
        shared_bytes: 0,
    })
}

pub fn dequant(n_blocks: usize) -> Result<Launch> {
    elementwise("dequant", n_blocks * 32)
}

/// One block per row of logits.
pub fn sampling(rows: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (dim_x("sampling", rows)?, 1, 1),
        block: (SAMPLE_THREADS, 1, 1),
        shared_bytes: 0,
    })
}

/// Output tile of `gemm.cu` (`G_BM` x `G_BN`).
pub const GEMM_TILE: usize = 64;
/// Threads of `gemm.cu`'s tensor-core kernels (four warps of 32x32) and of
/// its f32 kernel (16 x 16 threads of 4x4).
pub const GEMM_TC_THREADS: u32 = 128;
pub const GEMM_F32_THREADS: u32 = 256;

/// `gemm.cu`: one block per 64x64 tile of `y[rows, out]`; grid.x over
/// `out`, grid.y over `rows`.
pub fn gemm(rows: usize, out: usize, f32: bool) -> Result<Launch> {
    Ok(Launch {
        grid: (
            dim_x("gemm", out.div_ceil(GEMM_TILE))?,
            dim_yz("gemm", "row tiles", rows.div_ceil(GEMM_TILE))?,
            1,
        ),
        block: (
            if f32 {
                GEMM_F32_THREADS
            } else {
                GEMM_TC_THREADS
            },
            1,
            1,
        ),
        shared_bytes: 0,
    })
}

/// Rows up to which `gemm.cu`'s `gemm_small_*` (one warp per output column,
/// W streamed once) replaces the tiles (`GS_ROWS`), and its warps per block.
pub const GEMM_SMALL_ROWS: usize = 8;
pub const GEMM_SMALL_WARPS: usize = 8;

/// `gemm_small_*`: one warp per output column.
pub fn gemm_small(rows: usize, out: usize) -> Result<Launch> {
    if rows == 0 || rows > GEMM_SMALL_ROWS {
        return Err(shape(
            "gemm_small",
            format!("rows = {rows} is outside 1..={GEMM_SMALL_ROWS}"),
        ));
    }
    Ok(Launch {
        grid: (dim_x("gemm_small", out.div_ceil(GEMM_SMALL_WARPS))?, 1, 1),
        block: (GEMM_SMALL_WARPS as u32 * 32, 1, 1),
        shared_bytes: 0,
    })
}

/// Block tables as one `[num_seqs, max_blocks]` i32 array (row-major),
/// padded with block 0: a padding entry is never read, since the kernels
/// stop at the context length, and 0 is always a valid block if it were.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatBlockTables {
    pub data: Vec<i32>,
    pub max_blocks_per_seq: usize,
}

/// Flattens per-sequence block tables, checking each covers its context.
pub fn flatten_block_tables(
    tables: &[&[u32]],
    context_lens: &[usize],
    block_size: usize,
) -> Result<FlatBlockTables> {
    const K: &str = "block tables";
    if tables.len() != context_lens.len() {
        return Err(shape(
            K,
            format!(
                "{} tables for {} context lengths",
                tables.len(),
                context_lens.len()
            ),
        ));
    }
    if block_size == 0 {
        return Err(shape(K, "block_size = 0".into()));
    }
    let max_blocks = tables.iter().map(|t| t.len()).max().unwrap_or(0).max(1);
    let mut data = vec![0i32; tables.len() * max_blocks];
    for (s, (t, &n)) in tables.iter().zip(context_lens).enumerate() {
        if n.div_ceil(block_size) > t.len() {
            return Err(shape(
                K,
                format!(
                    "sequence {s}: {n} tokens need {} blocks, table has {}",
                    n.div_ceil(block_size),
                    t.len()
                ),
            ));
        }
        for (i, &b) in t.iter().enumerate() {
            data[s * max_blocks + i] =
                i32::try_from(b).map_err(|_| shape(K, format!("block id {b} exceeds i32")))?;
        }
    }
    Ok(FlatBlockTables {
        data,
        max_blocks_per_seq: max_blocks,
    })
}

/// Flat cache slot (`block * block_size + pos % block_size`) of each token
/// at `positions` in the sequence whose table is `table`.
pub fn slot_mapping(
    table: &[u32],
    positions: std::ops::Range<usize>,
    block_size: usize,
) -> Result<Vec<i64>> {
    positions
        .map(|p| {
            let b = table.get(p / block_size).ok_or_else(|| {
                shape(
                    "slot mapping",
                    format!("position {p} is past the table's {} blocks", table.len()),
                )
            })?;
            Ok(*b as i64 * block_size as i64 + (p % block_size) as i64)
        })
        .collect()
}

/// `[0, q0, q0+q1, ...]`: where each sequence's query rows start.
pub fn cu_seqlens(q_lens: &[usize]) -> Vec<i32> {
    let mut out = Vec::with_capacity(q_lens.len() + 1);
    let mut acc = 0i32;
    out.push(0);
    for &q in q_lens {
        acc += q as i32;
        out.push(acc);
    }
    out
}

/// Batch sizes decode graphs are captured for: powers of two up to
/// `max_batch`, and `max_batch` itself (vLLM captures a similar ladder).
pub fn graph_buckets(max_batch: usize) -> Vec<usize> {
    let mut b = Vec::new();
    let mut n = 1;
    while n < max_batch {
        b.push(n);
        n *= 2;
    }
    if max_batch > 0 {
        b.push(max_batch);
    }
    b
}

/// The smallest bucket that holds `batch` (the batch is padded up to it),
/// or `None` when the batch is larger than every bucket (run it eagerly).
pub fn bucket_for(batch: usize, buckets: &[usize]) -> Option<usize> {
    buckets.iter().copied().filter(|&b| b >= batch).min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_tiles_cover_the_output_once() {
        for (rows, out) in [
            (1, 1),
            (1, 4096),
            (63, 65),
            (64, 64),
            (65, 128_256),
            (16_384, 14_336),
        ] {
            let l = gemm(rows, out, false).unwrap();
            let (gx, gy) = (l.grid.0 as usize, l.grid.1 as usize);
            // Every output inside a tile, and no tile wholly outside.
            assert!(
                gx * GEMM_TILE >= out && (gx - 1) * GEMM_TILE < out,
                "{rows}x{out}"
            );
            assert!(
                gy * GEMM_TILE >= rows && (gy - 1) * GEMM_TILE < rows,
                "{rows}x{out}"
            );
            assert_eq!(l.block.0, 128);
            // The tensor-core kernel's 4 warps are 2x2 warps of 32x32.
            assert_eq!((l.block.0 / 32) as usize * 32 * 32, GEMM_TILE * GEMM_TILE);
        }
        // gemm_small: a warp per column, every column covered once.
        for out in [1, 8, 9, 4096, 128_256] {
            let l = gemm_small(8, out).unwrap();
            assert_eq!(l.block.0 as usize, GEMM_SMALL_WARPS * 32);
            let warps = l.grid.0 as usize * GEMM_SMALL_WARPS;
            assert!(warps >= out && warps - out < GEMM_SMALL_WARPS, "{out}");
        }
        assert!(gemm_small(9, 10).is_err() && gemm_small(0, 10).is_err());
        // The f32 kernel: 16x16 threads of 4x4 outputs.
        let l = gemm(5, 5, true).unwrap();
        assert_eq!(l.block.0 as usize * 16, GEMM_TILE * GEMM_TILE);
        assert!(gemm(0, 5, false).is_err() && gemm(5, 0, true).is_err());
    }

    #[test]
    fn elementwise_covers_every_element_once() {
        for n in [1, 255, 256, 257, 1 << 20] {
            let l = elementwise("x", n).unwrap();
            let threads = l.grid.0 as usize * l.block.0 as usize;
            assert!(threads >= n && threads - n < 256, "{n}");
        }
        assert!(elementwise("x", 0).is_err());
    }

    #[test]
    fn row_kernels_split_long_rows() {
        let l = embedding(7, 576).unwrap();
        assert_eq!(l.grid, (7, 3, 1));
        let l = kv_append(5, 8, 128).unwrap();
        assert_eq!(l.grid, (5, 4, 1));
        assert!(embedding(0, 576).is_err());
    }

    #[test]
    fn rmsnorm_threads_are_warps_and_capped() {
        assert_eq!(rmsnorm(3, 1).unwrap().block.0, 32);
        assert_eq!(rmsnorm(3, 576).unwrap().block.0, 576);
        assert_eq!(rmsnorm(3, 4096).unwrap().block.0, 1024);
        assert_eq!(rmsnorm(3, 100).unwrap().block.0, 128);
    }

    #[test]
    fn rope_is_one_thread_per_pair() {
        let l = rope(10, 9, 64).unwrap();
        assert_eq!(l.grid.0, (10 * 9 * 32usize).div_ceil(256) as u32);
        assert!(rope(1, 1, 63).is_err());
    }

    #[test]
    fn attention_shapes_are_checked() {
        assert_eq!(paged_decode(3, 32, 8, 128, 1).unwrap().grid, (32, 3, 1));
        assert_eq!(paged_decode(3, 32, 8, 128, 16).unwrap().grid, (32, 3, 16));
        assert!(paged_decode(3, 32, 8, 128, 0).is_err());
        assert!(paged_decode(3, 32, 5, 128, 1).is_err());
        assert!(paged_decode(3, 32, 8, 80, 1).is_err());
        assert!(paged_decode(3, 32, 8, 512, 1).is_err());
        assert_eq!(paged_merge(3, 32).unwrap().grid, (32, 3, 1));
        assert_eq!(prefill(2, 33, 9, 3, 64).unwrap().grid, (3, 9, 2));
        assert!(prefill(70_000, 1, 9, 3, 64).is_err());
    }

    #[test]
    fn decode_splits_long_tables_at_small_batches() {
        // Llama 3.1 8B (32 heads), 16-token blocks.
        // 1k context at batch 1: 2 partitions of 512 keys.
        assert_eq!(decode_partitions(1, 32, 64, 16), 2);
        // 8k at batch 1 and 8: 16 partitions; at batch 64 (2048 blocks): none.
        assert_eq!(decode_partitions(1, 32, 512, 16), 16);
        assert_eq!(decode_partitions(8, 32, 512, 16), 16);
        assert_eq!(decode_partitions(16, 32, 512, 16), 16);
        assert_eq!(decode_partitions(17, 32, 512, 16), 1);
        assert_eq!(decode_partitions(64, 32, 512, 16), 1);
        // Tables of at most 512 keys never split; one key more does.
        assert_eq!(decode_partitions(1, 32, 32, 16), 1);
        assert_eq!(decode_partitions(1, 32, 33, 16), 2);
        assert_eq!(decode_partitions(1, 32, 0, 16), 1);
        assert_eq!(decode_partials_len(2, 32, 128, 16), 2 * 32 * 16 * 130);
    }

    #[test]
    fn block_tables_flatten_with_padding() {
        let a = [3u32, 7];
        let b = [1u32];
        let f = flatten_block_tables(&[&a, &b], &[20, 5], 16).unwrap();
        assert_eq!(f.max_blocks_per_seq, 2);
        assert_eq!(f.data, vec![3, 7, 1, 0]);
        // 33 tokens need 3 blocks of 16.
        assert!(flatten_block_tables(&[&a], &[33], 16).is_err());
        assert!(flatten_block_tables(&[&a], &[1, 2], 16).is_err());
    }

    #[test]
    fn slots_follow_the_block_table() {
        let t = [5u32, 2];
        assert_eq!(slot_mapping(&t, 14..18, 16).unwrap(), vec![94, 95, 32, 33]);
        assert!(slot_mapping(&t, 30..33, 16).is_err());
    }

    #[test]
    fn cumulative_query_lengths() {
        assert_eq!(cu_seqlens(&[3, 1, 4]), vec![0, 3, 4, 8]);
        assert_eq!(cu_seqlens(&[]), vec![0]);
    }

    #[test]
    fn graph_buckets_and_choice() {
        assert_eq!(graph_buckets(64), vec![1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(graph_buckets(48), vec![1, 2, 4, 8, 16, 32, 48]);
        assert_eq!(graph_buckets(1), vec![1]);
        assert!(graph_buckets(0).is_empty());
        let b = graph_buckets(64);
        assert_eq!(bucket_for(1, &b), Some(1));
        assert_eq!(bucket_for(3, &b), Some(4));
        assert_eq!(bucket_for(33, &b), Some(64));
        assert_eq!(bucket_for(64, &b), Some(64));
        assert_eq!(bucket_for(65, &b), None);
    }
}
