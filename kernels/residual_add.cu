// Residual add: out = a + b (out may alias a); bias add: x[t, i] += b[i]
// for x = [rows, cols]. One thread per element.
#include "common.cuh"

template <typename T>
__device__ void residual_add(const T* a, const T* b, T* out, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

extern "C" __global__ void residual_add_f32(const float* a, const float* b, float* o, long long n) { residual_add(a, b, o, n); }
extern "C" __global__ void residual_add_f16(const __half* a, const __half* b, __half* o, long long n) { residual_add(a, b, o, n); }
extern "C" __global__ void residual_add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* o, long long n) { residual_add(a, b, o, n); }

template <typename T>
__device__ void bias_add(T* x, const T* b, long long n, int cols) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] = from_f32<T>(to_f32(x[i]) + to_f32(b[i % cols]));
}

extern "C" __global__ void bias_add_f32(float* x, const float* b, long long n, int c) { bias_add(x, b, n, c); }
extern "C" __global__ void bias_add_f16(__half* x, const __half* b, long long n, int c) { bias_add(x, b, n, c); }
extern "C" __global__ void bias_add_bf16(__nv_bfloat16* x, const __nv_bfloat16* b, long long n, int c) { bias_add(x, b, n, c); }
