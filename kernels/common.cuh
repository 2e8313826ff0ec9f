// Shared helpers for every kernel: element conversion for f32/f16/bf16 and
// warp/block reductions. Accumulation is always in f32.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <math.h>: INFINITY from its bit pattern.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned int u32;
typedef unsigned char u8;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x >> 5;
  float t = lane < nwarps ? partial[lane] : 0.0f;
  return warp_sum(t);
}

// Reads a little-endian f16 from a byte pointer with any alignment (GGUF
// blocks are 18, 20 or 34 bytes, so their scales are not 2-byte aligned).
__device__ __forceinline__ float f16_at(const u8* p) {
  unsigned short bits = (unsigned short)p[0] | ((unsigned short)p[1] << 8);
  return __half2float(__ushort_as_half(bits));
}
