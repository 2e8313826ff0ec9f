// Rotary position embedding, in place on x = [tokens, heads, head_dim], with
// the CPU engine's conventions (crates/envelope-engine/src/model.rs): angle =
// (float)pos * inv_freq[i] in f32 (inv_freq computed on the host exactly as
// the CPU does); interleaved = 1 rotates pairs (2i, 2i+1) (GGUF "normal"
// llama), interleaved = 0 rotates (i, i + head_dim/2) (neox / HF half split).
// One thread per (token, head, i < head_dim/2); 1-D grid.
#include "common.cuh"

template <typename T>
__device__ void rope(T* x, const u32* positions, const float* inv_freq, int n_tokens,
                     int heads, int head_dim, int interleaved) {
  const int half = head_dim / 2;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (long long)n_tokens * heads * half) return;
  const int i = idx % half;
  const long long th = idx / half;  // token * heads + head
  const int t = th / heads;
  const float a = (float)positions[t] * inv_freq[i];
  const float c = cosf(a), s = sinf(a);
  T* h = x + th * head_dim;
  const int i0 = interleaved ? 2 * i : i;
  const int i1 = interleaved ? 2 * i + 1 : i + half;
  const float x0 = to_f32(h[i0]), x1 = to_f32(h[i1]);
  h[i0] = from_f32<T>(x0 * c - x1 * s);
  h[i1] = from_f32<T>(x0 * s + x1 * c);
}

extern "C" __global__ void rope_f32(float* x, const u32* pos, const float* f, int n, int heads, int hd, int il) { rope(x, pos, f, n, heads, hd, il); }
extern "C" __global__ void rope_f16(__half* x, const u32* pos, const float* f, int n, int heads, int hd, int il) { rope(x, pos, f, n, heads, hd, il); }
extern "C" __global__ void rope_bf16(__nv_bfloat16* x, const u32* pos, const float* f, int n, int heads, int hd, int il) { rope(x, pos, f, n, heads, hd, il); }
