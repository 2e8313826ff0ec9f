// FP8 (e4m3) per-tensor quantisation for the fp8 GEMMs (weights at load,
// activations before every fp8 GEMM, as vLLM's dynamic per-tensor scheme):
//   absmax: *amax = max |x| (amax must start at 0; non-negative floats order
//   like their bit patterns, so atomicMax on the bits is a float max).
//   Grid-stride loop; any 1-D grid.
//   quant_fp8: scale = max(*amax, 1e-12) / 448 (e4m3's largest finite value),
//   out = e4m3(x / scale), round to nearest even, saturating (as
//   envelope_cuda::fp8::encode); thread 0 writes the scale for cuBLASLt's
//   A/B scale pointers. One thread per element.
#include "common.cuh"
#include <cuda_fp8.h>

template <typename T>
__device__ void absmax(const T* x, long long n, float* amax) {
  float m = 0.0f;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    m = fmaxf(m, fabsf(to_f32(x[i])));
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) atomicMax((unsigned int*)amax, __float_as_uint(m));
}

template <typename T>
__device__ void quant_fp8(const T* x, u8* out, long long n, const float* amax, float* scale_out) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const float s = fmaxf(*amax, 1e-12f) / 448.0f;
  if (i == 0) *scale_out = s;
  if (i >= n) return;
  out[i] = (u8)__nv_cvt_float_to_fp8(to_f32(x[i]) / s, __NV_SATFINITE, __NV_E4M3);
}

extern "C" __global__ void absmax_f32(const float* x, long long n, float* a) { absmax(x, n, a); }
extern "C" __global__ void absmax_f16(const __half* x, long long n, float* a) { absmax(x, n, a); }
extern "C" __global__ void absmax_bf16(const __nv_bfloat16* x, long long n, float* a) { absmax(x, n, a); }
extern "C" __global__ void quant_fp8_f32(const float* x, u8* o, long long n, const float* a, float* s) { quant_fp8(x, o, n, a, s); }
extern "C" __global__ void quant_fp8_f16(const __half* x, u8* o, long long n, const float* a, float* s) { quant_fp8(x, o, n, a, s); }
extern "C" __global__ void quant_fp8_bf16(const __nv_bfloat16* x, u8* o, long long n, const float* a, float* s) { quant_fp8(x, o, n, a, s); }
