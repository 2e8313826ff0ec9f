// Embedding gather: out[t, :] = table[ids[t], :].
// Grid: (n_tokens, ceil(hidden / blockDim.x)); any block size.
#include "common.cuh"

template <typename T>
__device__ void embedding(const u32* ids, const T* table, T* out, int hidden) {
  const int t = blockIdx.x;
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= hidden) return;
  out[(size_t)t * hidden + i] = table[(size_t)ids[t] * hidden + i];
}

extern "C" __global__ void embedding_f32(const u32* ids, const float* table, float* out, int hidden) { embedding(ids, table, out, hidden); }
extern "C" __global__ void embedding_f16(const u32* ids, const __half* table, __half* out, int hidden) { embedding(ids, table, out, hidden); }
extern "C" __global__ void embedding_bf16(const u32* ids, const __nv_bfloat16* table, __nv_bfloat16* out, int hidden) { embedding(ids, table, out, hidden); }
