// The linear layer's GEMM for machines where cuBLAS is absent (a driver and
// nothing else) or switched off (ENVELOPE_GEMM=kernels):
//   y[rows, out] (+)= x[rows, inner] . W[out, inner]^T      ("TN")
// with f32 accumulation; `accumulate` != 0 adds y's previous value before
// the single rounding to y's type (cuBLAS's beta = 1: the residual add).
//
//   gemm_f16_*, gemm_bf16_*: tensor cores (PTX mma.sync m16n8k16, sm_80+).
//   gemm_fp8_bf16: e4m3 operands with per-tensor scales (*sx, *sw), widened
//     to f16 in shared memory. Every e4m3 value is an f16 value, so the
//     products are exactly the W8A8 products cuBLASLt forms; the scales
//     multiply the f32 sum once, as cuBLASLt's scale pointers do.
//   gemm_f32_f32: CUDA cores, f32 FMA, no TF32 (as cuBLAS's f32 path).
//
// gemm_small_*: the same products for at most 8 rows (decode), one warp per
// output column streaming W once (see below).
//
// Tiles: 64x64 outputs per block, K in steps of 32 (tensor cores: 128 threads,
// four warps of 32x32; f32: 256 threads of 4x4). Grid: (ceil(out/64),
// ceil(rows/64)). Edges are zero-filled in shared memory, so any shape runs.
#include "common.cuh"
#include <cuda_fp8.h>

#define G_BM 64
#define G_BN 64
#define G_BK 32
// Shared row stride of the 16-bit tiles: 40 elements (20 words) keep 16-byte
// rows aligned for the vector stores and put the eight rows a fragment load
// touches on different banks.
#define G_LDS (G_BK + 8)

// One operand element as the 16-bit type the tensor cores read.
__device__ __forceinline__ __half widen(__half v) { return v; }
__device__ __forceinline__ __nv_bfloat16 widen(__nv_bfloat16 v) { return v; }
__device__ __forceinline__ __half widen(u8 v) {
  return __half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)v, __NV_E4M3));
}

template <typename In> struct Smem { typedef In T; };
template <> struct Smem<u8> { typedef __half T; };

// Copies the [64, 32] tile of `src` ([n_rows, inner], row-major) starting at
// (row0, k0) into `dst` (stride G_LDS), zero outside the matrix. `vec`: rows
// are 16-byte aligned in global memory and inner is a multiple of 8, so
// eight elements move at once.
template <typename In, typename S>
__device__ __forceinline__ void load_tile(S* dst, const In* src, int n_rows, int inner, int row0,
                                          int k0, bool vec) {
  for (int v = threadIdx.x; v < G_BM * G_BK / 8; v += blockDim.x) {
    const int r = v / (G_BK / 8), c = (v % (G_BK / 8)) * 8;
    const int gr = row0 + r, gk = k0 + c;
    S* d = dst + r * G_LDS + c;
    if (vec && gr < n_rows && gk + 8 <= inner) {
      const In* s = src + (long long)gr * inner + gk;
      if constexpr (sizeof(In) == 2) {
        *(uint4*)d = *(const uint4*)s;
      } else {
        __align__(8) In e[8];
        *(uint2*)e = *(const uint2*)s;
#pragma unroll
        for (int i = 0; i < 8; i++) d[i] = widen(e[i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const bool in = gr < n_rows && gk + i < inner;
        d[i] = in ? widen(src[(long long)gr * inner + gk + i]) : S(0.0f);
      }
    }
  }
}

#ifndef ENVELOPE_EMU  // the CPU emulator (crates/envelope-cuda/emu) has its own
// D += A . B for one 16x8x16 tile on the tensor cores (PTX mma.sync; the
// fragment layout is PTX ISA's "mma.m16n8k16" for 16-bit types: g = lane/4,
// t = lane%4; a: rows g and g+8, k pairs 2t and 2t+8; b: column g, k pairs
// 2t and 2t+8; d: rows g and g+8, columns 2t and 2t+1).
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b, __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b, __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Two consecutive 16-bit elements of a shared tile as one register.
template <typename S> __device__ __forceinline__ u32 pair(const S* p) { return *(const u32*)p; }

template <typename In, typename Out>
__device__ void gemm_tc(const In* x, const In* w, Out* y, int rows, int inner, int out,
                        int accumulate, const float* sx, const float* sw) {
  typedef typename Smem<In>::T S;
  __shared__ __align__(16) S xs[G_BM * G_LDS];
  __shared__ __align__(16) S ws[G_BN * G_LDS];

  const int row0 = blockIdx.y * G_BM, col0 = blockIdx.x * G_BN;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;  // the warp's 32x32
  const int g = lane >> 2, t = lane & 3;
  const bool xvec = inner % 8 == 0 && ((size_t)x % 16) == 0;
  const bool wvec = inner % 8 == 0 && ((size_t)w % 16) == 0;

  float acc[2][4][4];  // [16-row tile][8-column tile][fragment]
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int f = 0; f < 4; f++) acc[i][j][f] = 0.0f;

  for (int k0 = 0; k0 < inner; k0 += G_BK) {
    load_tile(xs, x, rows, inner, row0, k0, xvec);
    load_tile(ws, w, out, inner, col0, k0, wvec);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < G_BK; kk += 16) {
      u32 a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const S* p = xs + (wm + i * 16 + g) * G_LDS + kk + 2 * t;
        a[i][0] = pair(p);
        a[i][1] = pair(p + 8 * G_LDS);
        a[i][2] = pair(p + 8);
        a[i][3] = pair(p + 8 * G_LDS + 8);
      }
      // W's rows are the columns of W^T, so a column of B is a row of ws.
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const S* p = ws + (wn + j * 8 + g) * G_LDS + kk + 2 * t;
        b[j][0] = pair(p);
        b[j][1] = pair(p + 8);
      }
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) mma_16816(acc[i][j], a[i], b[j], S());
    }
    __syncthreads();
  }

  const float scale = (sx ? *sx : 1.0f) * (sw ? *sw : 1.0f);
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int f = 0; f < 4; f++) {
        const int gr = row0 + wm + i * 16 + g + (f >> 1) * 8;
        const int gc = col0 + wn + j * 8 + 2 * t + (f & 1);
        if (gr >= rows || gc >= out) continue;
        const long long idx = (long long)gr * out + gc;
        float v = acc[i][j][f] * scale;
        if (accumulate) v += to_f32(y[idx]);
        y[idx] = from_f32<Out>(v);
      }
}

// f32 on CUDA cores: 16x16 threads, each owning rows ty + 16i and columns
// tx + 16j (i, j < 4) of the 64x64 tile; the tiles are stored k-major so a
// step of k reads one broadcast row of each.
#define F_BK 16
__device__ void gemm_f32(const float* x, const float* w, float* y, int rows, int inner, int out,
                         int accumulate) {
  __shared__ float xs[F_BK][G_BM + 1];
  __shared__ float ws[F_BK][G_BN + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int row0 = blockIdx.y * G_BM, col0 = blockIdx.x * G_BN;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < inner; k0 += F_BK) {
    for (int e = threadIdx.x; e < G_BM * F_BK; e += blockDim.x) {
      const int r = e / F_BK, k = e % F_BK;
      const int gk = k0 + k;
      xs[k][r] = (row0 + r < rows && gk < inner) ? x[(long long)(row0 + r) * inner + gk] : 0.0f;
      ws[k][r] = (col0 + r < out && gk < inner) ? w[(long long)(col0 + r) * inner + gk] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < F_BK; k++) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; i++) a[i] = xs[k][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; j++) b[j] = ws[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int gr = row0 + ty + 16 * i, gc = col0 + tx + 16 * j;
      if (gr >= rows || gc >= out) continue;
      const long long idx = (long long)gr * out + gc;
      y[idx] = accumulate ? y[idx] + acc[i][j] : acc[i][j];
    }
}

// Decode-sized GEMMs (rows <= GS_ROWS): memory-bound, so no tiles and no
// shared memory. Each warp owns one output column n and streams W's row n
// once, eight elements per lane per load (16 bytes of 16-bit weights),
// with every x row (small, cached) against it; a warp sum per row, lane 0
// writes. 8 warps per block: grid = ceil(out / 8).
#define GS_ROWS 8
#define GS_WARPS 8

__device__ __forceinline__ void widen8(const float* p, float* o) {
  const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
template <typename T> __device__ __forceinline__ void widen8(const T* p, float* o) {
  __align__(16) T e[8];
  *(uint4*)e = *(const uint4*)p;
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = to_f32(e[i]);
}
__device__ __forceinline__ void widen8(const u8* p, float* o) {
  __align__(8) u8 e[8];
  *(uint2*)e = *(const uint2*)p;
#pragma unroll
  for (int i = 0; i < 8; i++) o[i] = __half2float(widen(e[i]));
}
__device__ __forceinline__ float widen1(float v) { return v; }
__device__ __forceinline__ float widen1(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen1(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen1(u8 v) { return __half2float(widen(v)); }

template <typename In, typename Out>
__device__ void gemm_small(const In* x, const In* w, Out* y, int rows, int inner, int out,
                           int accumulate, const float* sx, const float* sw) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * GS_WARPS + (threadIdx.x >> 5);
  if (n >= out) return;  // a whole warp leaves together
  const In* wr = w + (long long)n * inner;
  const bool vec = inner % 8 == 0 && ((size_t)x % 16) == 0 && ((size_t)w % 16) == 0;
  float acc[GS_ROWS];
#pragma unroll
  for (int r = 0; r < GS_ROWS; r++) acc[r] = 0.0f;
  const int main_end = vec ? inner : 0;
  for (int k = lane * 8; k < main_end; k += 32 * 8) {
    float wv[8];
    widen8(wr + k, wv);
#pragma unroll
    for (int r = 0; r < GS_ROWS; r++) {
      if (r >= rows) break;
      float xv[8];
      widen8(x + (long long)r * inner + k, xv);
#pragma unroll
      for (int i = 0; i < 8; i++) acc[r] = fmaf(xv[i], wv[i], acc[r]);
    }
  }
  for (int k = main_end + lane; k < inner; k += 32) {
    const float wv = widen1(wr[k]);
#pragma unroll
    for (int r = 0; r < GS_ROWS; r++) {
      if (r >= rows) break;
      acc[r] = fmaf(widen1(x[(long long)r * inner + k]), wv, acc[r]);
    }
  }
  const float scale = (sx ? *sx : 1.0f) * (sw ? *sw : 1.0f);
#pragma unroll
  for (int r = 0; r < GS_ROWS; r++) {
    if (r >= rows) break;
    const float v = warp_sum(acc[r]) * scale;
    if (lane == 0) {
      const long long idx = (long long)r * out + n;
      y[idx] = from_f32<Out>(accumulate ? v + to_f32(y[idx]) : v);
    }
  }
}

extern "C" __global__ void gemm_small_f32_f32(const float* x, const float* w, float* y, int rows, int inner, int out, int acc) { gemm_small(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_small_f16_f16(const __half* x, const __half* w, __half* y, int rows, int inner, int out, int acc) { gemm_small(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_small_f16_f32(const __half* x, const __half* w, float* y, int rows, int inner, int out, int acc) { gemm_small(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_small_bf16_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int rows, int inner, int out, int acc) { gemm_small(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_small_bf16_f32(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int rows, int inner, int out, int acc) { gemm_small(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_small_fp8_bf16(const u8* x, const u8* w, __nv_bfloat16* y, int rows, int inner, int out, int acc, const float* sx, const float* sw) { gemm_small(x, w, y, rows, inner, out, acc, sx, sw); }

extern "C" __global__ void gemm_f32_f32(const float* x, const float* w, float* y, int rows, int inner, int out, int acc) { gemm_f32(x, w, y, rows, inner, out, acc); }
extern "C" __global__ void gemm_f16_f16(const __half* x, const __half* w, __half* y, int rows, int inner, int out, int acc) { gemm_tc(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_f16_f32(const __half* x, const __half* w, float* y, int rows, int inner, int out, int acc) { gemm_tc(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_bf16_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int rows, int inner, int out, int acc) { gemm_tc(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_bf16_f32(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int rows, int inner, int out, int acc) { gemm_tc(x, w, y, rows, inner, out, acc, nullptr, nullptr); }
extern "C" __global__ void gemm_fp8_bf16(const u8* x, const u8* w, __nv_bfloat16* y, int rows, int inner, int out, int acc, const float* sx, const float* sw) { gemm_tc(x, w, y, rows, inner, out, acc, sx, sw); }
