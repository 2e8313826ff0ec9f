// Prefill (and chunked-prefill) attention, tiled with an online softmax in
// the manner of FlashAttention: no n x n score matrix exists anywhere. The
// new tokens' K/V are already in the paged cache (kv_append runs first), so
// a chunk attends to earlier chunks through the same block table.
//   q, out: [total_q_tokens, num_heads, head_dim]; sequence s owns query rows
//   cu_q_lens[s] .. cu_q_lens[s + 1]; its keys are 0 .. context_lens[s], and
//   query row i sits at position context_lens[s] - q_len + i (causal mask).
// Grid: (ceil(max_q_len / PF_BQ), num_heads, num_seqs); block: PF_WARPS warps,
// each owning PF_BQ / PF_WARPS query rows. K/V tiles of PF_BK keys are staged
// in shared memory as f32. head_dim a multiple of 32, at most 256.
#include "common.cuh"

#define PF_WARPS 4
#define PF_BQ 16
#define PF_BK 16
#define PF_ROWS (PF_BQ / PF_WARPS)
#define PF_MAX_HD 256
#define PF_PER_LANE (PF_MAX_HD / 32)

template <typename TQ, typename TC>
__device__ void prefill_attention(TQ* out, const TQ* q, const TC* k_cache, const TC* v_cache,
                                  const int* block_tables, const int* cu_q_lens,
                                  const int* context_lens, int max_blocks_per_seq, int num_heads,
                                  int num_kv_heads, int head_dim, int block_size, float scale) {
  __shared__ float s_k[PF_BK][PF_MAX_HD];
  __shared__ float s_v[PF_BK][PF_MAX_HD];
  const int head = blockIdx.y, seq = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q0 = cu_q_lens[seq], q_len = cu_q_lens[seq + 1] - q0;
  const int tile_row0 = blockIdx.x * PF_BQ;
  if (tile_row0 >= q_len) return;  // whole block exits: no barrier is skipped by part of it
  const int n_keys = context_lens[seq];
  const int first_pos = n_keys - q_len;
  const int kvh = head / (num_heads / num_kv_heads);
  const int per_lane = head_dim / 32;
  const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
  const size_t stride = (size_t)num_kv_heads * head_dim;

  float qv[PF_ROWS][PF_PER_LANE], acc[PF_ROWS][PF_PER_LANE], m[PF_ROWS], l[PF_ROWS];
  int pos[PF_ROWS];
#pragma unroll
  for (int r = 0; r < PF_ROWS; r++) {
    const int row = tile_row0 + warp * PF_ROWS + r;
    pos[r] = row < q_len ? first_pos + row : -1;  // -1: padding row, attends nothing
    const TQ* qh = q + ((size_t)(q0 + (row < q_len ? row : 0)) * num_heads + head) * head_dim;
#pragma unroll
    for (int j = 0; j < PF_PER_LANE; j++) {
      qv[r][j] = (j < per_lane && pos[r] >= 0) ? to_f32(qh[lane + 32 * j]) * scale : 0.0f;
      acc[r][j] = 0.0f;
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  // Keys past the tile's last query position are masked for every row.
  const int last_pos = first_pos + min(tile_row0 + PF_BQ, q_len) - 1;
  for (int k0 = 0; k0 <= last_pos; k0 += PF_BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < PF_BK * head_dim; e += blockDim.x) {
      const int kk = e / head_dim, d = e % head_dim, t = k0 + kk;
      float kval = 0.0f, vval = 0.0f;
      if (t <= last_pos) {
        const size_t off = ((size_t)table[t / block_size] * block_size + t % block_size) * stride +
                           (size_t)kvh * head_dim + d;
        kval = to_f32(k_cache[off]);
        vval = to_f32(v_cache[off]);
      }
      s_k[kk][d] = kval;
      s_v[kk][d] = vval;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < PF_ROWS; r++) {
      const int kmax = min(PF_BK, pos[r] - k0 + 1);  // causal: keys k0 .. pos
      for (int kk = 0; kk < kmax; kk++) {
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < PF_PER_LANE; j++)
          if (j < per_lane) dot += qv[r][j] * s_k[kk][lane + 32 * j];
        const float s = warp_sum(dot);
        const float m_new = fmaxf(m[r], s);
        const float corr = expf(m[r] - m_new), p = expf(s - m_new);
        l[r] = l[r] * corr + p;
#pragma unroll
        for (int j = 0; j < PF_PER_LANE; j++)
          if (j < per_lane) acc[r][j] = acc[r][j] * corr + p * s_v[kk][lane + 32 * j];
        m[r] = m_new;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < PF_ROWS; r++) {
    if (pos[r] < 0) continue;
    const int row = tile_row0 + warp * PF_ROWS + r;
    TQ* oh = out + ((size_t)(q0 + row) * num_heads + head) * head_dim;
#pragma unroll
    for (int j = 0; j < PF_PER_LANE; j++)
      if (j < per_lane) oh[lane + 32 * j] = from_f32<TQ>(acc[r][j] / l[r]);
  }
}

#define PREFILL(name, TQ, TC)                                                                       \
  extern "C" __global__ void name(TQ* out, const TQ* q, const TC* kc, const TC* vc, const int* bt,  \
                                  const int* cu, const int* cl, int mb, int nh, int nkv, int hd,    \
                                  int bs, float sc) {                                               \
    prefill_attention(out, q, kc, vc, bt, cu, cl, mb, nh, nkv, hd, bs, sc);                         \
  }
PREFILL(prefill_attention_f32_f32, float, float)
PREFILL(prefill_attention_f32_f16, float, __half)
PREFILL(prefill_attention_f32_bf16, float, __nv_bfloat16)
PREFILL(prefill_attention_f16_f16, __half, __half)
PREFILL(prefill_attention_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
