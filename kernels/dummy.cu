// Deterministic dummy weights generated on the device, bit for bit the
// values crates/envelope-engine/src/weights.rs (dummy_values) makes on the
// CPU: element i of a tensor is splitmix64(key ^ i) mapped to a uniform in
// [-scale, scale), rounded to bf16 (the dtype dummy checkpoints are "stored"
// in), then converted to T. key = splitmix64(seed ^ fnv1a(tensor name)) is
// computed on the host. Explicit _rn arithmetic: no FMA contraction, the
// same two roundings as the CPU. One thread per element; 1-D grid.
#include "common.cuh"

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
__device__ void dummy_fill(T* out, long long n, unsigned long long key, float scale) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const unsigned long long h = splitmix64(key ^ (unsigned long long)i);
  const float unit = (float)(h >> 40) * (1.0f / 16777216.0f);
  const float v = __fmul_rn(__fadd_rn(__fmul_rn(unit, 2.0f), -1.0f), scale);
  out[i] = from_f32<T>(__bfloat162float(__float2bfloat16_rn(v)));
}

extern "C" __global__ void dummy_fill_f32(float* o, long long n, unsigned long long key, float s) { dummy_fill(o, n, key, s); }
extern "C" __global__ void dummy_fill_f16(__half* o, long long n, unsigned long long key, float s) { dummy_fill(o, n, key, s); }
extern "C" __global__ void dummy_fill_bf16(__nv_bfloat16* o, long long n, unsigned long long key, float s) { dummy_fill(o, n, key, s); }
