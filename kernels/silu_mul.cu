// SwiGLU's elementwise part: out = silu(gate) * up, silu(g) = g / (1 + e^-g).
// One thread per element; 1-D grid.
#include "common.cuh"

template <typename T>
__device__ void silu_mul(const T* gate, const T* up, T* out, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = to_f32(gate[i]);
  out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up[i]));
}

extern "C" __global__ void silu_mul_f32(const float* g, const float* u, float* o, long long n) { silu_mul(g, u, o, n); }
extern "C" __global__ void silu_mul_f16(const __half* g, const __half* u, __half* o, long long n) { silu_mul(g, u, o, n); }
extern "C" __global__ void silu_mul_bf16(const __nv_bfloat16* g, const __nv_bfloat16* u, __nv_bfloat16* o, long long n) { silu_mul(g, u, o, n); }
