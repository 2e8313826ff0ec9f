// GGUF block dequantisation (ggml's layouts, as crates/envelope-engine/src/
// qgemm.rs reads them), 32 weights per block, little-endian f16 scales:
//   Q4_0: 18 bytes = d, qs[16]; w[i] = (lo nibble of qs[i] - 8) * d, w[i+16] from the hi nibble
//   Q4_1: 20 bytes = d, m, qs[16]; w = nibble * d + m
//   Q8_0: 34 bytes = d, qs[32] (i8); w[i] = qs[i] * d
// One thread per output weight; 1-D grid over n_blocks * 32.
#include "common.cuh"

template <typename T>
__device__ void dequant_q4_0(const u8* blocks, T* out, long long n_blocks) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n_blocks * 32) return;
  const u8* b = blocks + (idx / 32) * 18;
  const int i = idx % 32;
  const float d = f16_at(b);
  const int q = i < 16 ? (b[2 + i] & 0x0F) : (b[2 + i - 16] >> 4);
  // Explicit roundings, no FMA: the CPU's (q * d) + (-8 * d), bit for bit.
  out[idx] = from_f32<T>(__fadd_rn(__fmul_rn((float)q, d), -8.0f * d));
}

template <typename T>
__device__ void dequant_q4_1(const u8* blocks, T* out, long long n_blocks) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n_blocks * 32) return;
  const u8* b = blocks + (idx / 32) * 20;
  const int i = idx % 32;
  const float d = f16_at(b), m = f16_at(b + 2);
  const int q = i < 16 ? (b[4 + i] & 0x0F) : (b[4 + i - 16] >> 4);
  out[idx] = from_f32<T>(__fadd_rn(__fmul_rn((float)q, d), m));
}

template <typename T>
__device__ void dequant_q8_0(const u8* blocks, T* out, long long n_blocks) {
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n_blocks * 32) return;
  const u8* b = blocks + (idx / 32) * 34;
  const int i = idx % 32;
  out[idx] = from_f32<T>((float)(signed char)b[2 + i] * f16_at(b));
}

#define DEQ(fmt, suffix, T) \
  extern "C" __global__ void dequant_##fmt##_##suffix(const u8* b, T* o, long long n) { dequant_##fmt(b, o, n); }
DEQ(q4_0, f32, float) DEQ(q4_0, f16, __half) DEQ(q4_0, bf16, __nv_bfloat16)
DEQ(q4_1, f32, float) DEQ(q4_1, f16, __half) DEQ(q4_1, bf16, __nv_bfloat16)
DEQ(q8_0, f32, float) DEQ(q8_0, f16, __half) DEQ(q8_0, bf16, __nv_bfloat16)
