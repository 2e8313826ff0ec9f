// RMSNorm over rows: out = x / sqrt(mean(x^2) + eps) * w, as candle's
// rms_norm computes it (f32 accumulation, divide by the root).
// Grid: (rows); block: a multiple of 32, at most 1024.
#include "common.cuh"

template <typename T>
__device__ void rmsnorm(const T* x, const T* w, T* out, int hidden, float eps) {
  const T* row = x + (size_t)blockIdx.x * hidden;
  T* dst = out + (size_t)blockIdx.x * hidden;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_f32(row[i]);
    ss += v * v;
  }
  ss = block_sum(ss);
  const float m = sqrtf(ss / (float)hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    dst[i] = from_f32<T>(to_f32(row[i]) / m * to_f32(w[i]));
  }
}

extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* out, int hidden, float eps) { rmsnorm(x, w, out, hidden, eps); }
extern "C" __global__ void rmsnorm_f16(const __half* x, const __half* w, __half* out, int hidden, float eps) { rmsnorm(x, w, out, hidden, eps); }
extern "C" __global__ void rmsnorm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* out, int hidden, float eps) { rmsnorm(x, w, out, hidden, eps); }
