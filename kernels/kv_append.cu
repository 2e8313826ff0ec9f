// Paged KV append (vLLM's reshape_and_cache): token t's K and V rows
// ([kv_heads * head_dim] each) go to flat slot slot_mapping[t] = block *
// block_size + pos % block_size of a cache laid out [block][slot][kv_head]
// [head_dim], the CPU engine's layout (crates/envelope-engine/src/kv_cache.rs).
// A negative slot skips the token (padding). Grid: (n_tokens, ceil(stride /
// blockDim.x)).
#include "common.cuh"

template <typename TIn, typename TCache>
__device__ void kv_append(const TIn* k, const TIn* v, TCache* k_cache, TCache* v_cache,
                          const long long* slot_mapping, int token_stride) {
  const int t = blockIdx.x;
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0 || i >= token_stride) return;
  const size_t src = (size_t)t * token_stride + i, dst = (size_t)slot * token_stride + i;
  k_cache[dst] = from_f32<TCache>(to_f32(k[src]));
  v_cache[dst] = from_f32<TCache>(to_f32(v[src]));
}

#define KV_APPEND(name, TIn, TCache) \
  extern "C" __global__ void name(const TIn* k, const TIn* v, TCache* kc, TCache* vc, const long long* slots, int stride) { kv_append(k, v, kc, vc, slots, stride); }
KV_APPEND(kv_append_f32_f32, float, float)
KV_APPEND(kv_append_f32_f16, float, __half)
KV_APPEND(kv_append_f32_bf16, float, __nv_bfloat16)
KV_APPEND(kv_append_f16_f16, __half, __half)
KV_APPEND(kv_append_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
