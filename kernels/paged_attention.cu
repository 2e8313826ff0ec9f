// Paged decode attention: one query token per sequence against its cached
// keys 0..context_len through its block table (cache layout [block][slot]
// [kv_head][head_dim]; grouped-query: query head h reads kv head h / group).
// Grid: (num_heads, num_seqs, partitions); block: PA_WARPS warps. Each warp
// walks a strided subset of its block's keys with an online softmax (running
// max, running sum, rescaled accumulator); the warps' partial results are
// merged at the end. head_dim must be a multiple of 32 and at most 256.
//
// Split (flash-decoding, vLLM's PagedAttention V2): with partitions > 1, the
// block of partition z takes keys [z * part_size, (z + 1) * part_size) and
// writes a record (max, sum, unnormalised accumulator[head_dim]) in f32 to
// partials[seq][head][z]; paged_attention_merge combines the records. A
// partition past the context writes (-inf, 0, zeros), which the merge skips.
// Without a split (partitions == 1) the block writes the output directly and
// partials is not read (null). So short contexts and large batches take one
// launch, and a long context at a small batch is spread over the SMs.
#include "common.cuh"

#define PA_WARPS 4
#define PA_MAX_HD 256
#define PA_PER_LANE (PA_MAX_HD / 32)

template <typename TQ, typename TC>
__device__ void paged_attention_decode(TQ* out, const TQ* q, const TC* k_cache, const TC* v_cache,
                                       const int* block_tables, const int* context_lens,
                                       int max_blocks_per_seq, int num_heads, int num_kv_heads,
                                       int head_dim, int block_size, float scale, float* partials,
                                       int part_size) {
  __shared__ float s_acc[PA_WARPS][PA_MAX_HD];
  __shared__ float s_m[PA_WARPS], s_l[PA_WARPS];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int parts = gridDim.z, part = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = head / (num_heads / num_kv_heads);
  const int n = context_lens[seq];
  const int t0 = parts == 1 ? 0 : part * part_size;
  const int t1 = parts == 1 ? n : min(n, t0 + part_size);
  const int per_lane = head_dim / 32;
  const int* table = block_tables + (size_t)seq * max_blocks_per_seq;
  const TQ* qh = q + ((size_t)seq * num_heads + head) * head_dim;
  const size_t stride = (size_t)num_kv_heads * head_dim;

  float qv[PA_PER_LANE], acc[PA_PER_LANE];
#pragma unroll
  for (int j = 0; j < PA_PER_LANE; j++) {
    qv[j] = j < per_lane ? to_f32(qh[lane + 32 * j]) : 0.0f;
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int t = t0 + warp; t < t1; t += PA_WARPS) {
    const size_t off = ((size_t)table[t / block_size] * block_size + t % block_size) * stride +
                       (size_t)kvh * head_dim;
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < PA_PER_LANE; j++)
      if (j < per_lane) dot += qv[j] * to_f32(k_cache[off + lane + 32 * j]);
    const float s = warp_sum(dot) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), p = expf(s - m_new);
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < PA_PER_LANE; j++)
      if (j < per_lane) acc[j] = acc[j] * corr + p * to_f32(v_cache[off + lane + 32 * j]);
    m = m_new;
  }
#pragma unroll
  for (int j = 0; j < PA_PER_LANE; j++)
    if (j < per_lane) s_acc[warp][lane + 32 * j] = acc[j];
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
  __syncthreads();
  float gm = -INFINITY;
  for (int w = 0; w < PA_WARPS; w++)
    if (s_l[w] > 0.0f) gm = fmaxf(gm, s_m[w]);
  float gl = 0.0f;
  for (int w = 0; w < PA_WARPS; w++)
    if (s_l[w] > 0.0f) gl += s_l[w] * expf(s_m[w] - gm);
  if (parts == 1) {
    TQ* oh = out + ((size_t)seq * num_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float o = 0.0f;
      for (int w = 0; w < PA_WARPS; w++)
        if (s_l[w] > 0.0f) o += s_acc[w][d] * expf(s_m[w] - gm);
      oh[d] = from_f32<TQ>(gl > 0.0f ? o / gl : 0.0f);
    }
    return;
  }
  float* rec = partials + (((size_t)seq * num_heads + head) * parts + part) * (head_dim + 2);
  if (threadIdx.x == 0) {
    rec[0] = gm;
    rec[1] = gl;
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < PA_WARPS; w++)
      if (s_l[w] > 0.0f) o += s_acc[w][d] * expf(s_m[w] - gm);
    rec[2 + d] = o;
  }
}

#define PA_DECODE(name, TQ, TC)                                                                   \
  extern "C" __global__ void name(TQ* out, const TQ* q, const TC* kc, const TC* vc, const int* bt, \
                                  const int* cl, int mb, int nh, int nkv, int hd, int bs, float sc, \
                                  float* partials, int part_size) {                               \
    paged_attention_decode(out, q, kc, vc, bt, cl, mb, nh, nkv, hd, bs, sc, partials, part_size); \
  }
PA_DECODE(paged_attention_decode_f32_f32, float, float)
PA_DECODE(paged_attention_decode_f32_f16, float, __half)
PA_DECODE(paged_attention_decode_f32_bf16, float, __nv_bfloat16)
PA_DECODE(paged_attention_decode_f16_f16, __half, __half)
PA_DECODE(paged_attention_decode_bf16_bf16, __nv_bfloat16, __nv_bfloat16)

// The split's second pass. Grid: (num_heads, num_seqs); block: any width
// (PA_WARPS warps). Rescales each partition's record to the largest max and
// normalises by the combined sum; records with sum 0 (past the context) are
// skipped, and a sequence with no keys at all gets zeros, as unsplit.
template <typename TQ>
__device__ void paged_attention_merge(TQ* out, const float* partials, int num_heads, int head_dim,
                                      int parts) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const size_t rec = (size_t)head_dim + 2;
  const float* recs = partials + ((size_t)seq * num_heads + head) * parts * rec;
  float gm = -INFINITY;
  for (int p = 0; p < parts; p++)
    if (recs[p * rec + 1] > 0.0f) gm = fmaxf(gm, recs[p * rec]);
  float gl = 0.0f;
  for (int p = 0; p < parts; p++)
    if (recs[p * rec + 1] > 0.0f) gl += recs[p * rec + 1] * expf(recs[p * rec] - gm);
  TQ* oh = out + ((size_t)seq * num_heads + head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int p = 0; p < parts; p++)
      if (recs[p * rec + 1] > 0.0f) o += recs[p * rec + 2 + d] * expf(recs[p * rec] - gm);
    oh[d] = from_f32<TQ>(gl > 0.0f ? o / gl : 0.0f);
  }
}

#define PA_MERGE(name, TQ)                                                                    \
  extern "C" __global__ void name(TQ* out, const float* partials, int nh, int hd, int parts) { \
    paged_attention_merge(out, partials, nh, hd, parts);                                      \
  }
PA_MERGE(paged_attention_merge_f32, float)
PA_MERGE(paged_attention_merge_f16, __half)
PA_MERGE(paged_attention_merge_bf16, __nv_bfloat16)
