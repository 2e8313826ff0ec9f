// A CPU emulator of the CUDA subset kernels/*.cu use, so that the kernels'
// own source runs, unchanged, in CI machines without a GPU
// (crates/envelope-cuda/src/emu.rs compiles each kernel file with the host
// C++ compiler against this header and runs the GPU self-test's cases on it).
//
// Execution model: one launch at a time (a mutex); blocks one after another;
// the threads of a block are fibers (ucontext) on one OS thread, switched at
// __syncthreads and at warp-collective operations, so barriers, shared
// memory and warp shuffles behave as on the GPU for race-free kernels. A
// thread that returns early leaves the barriers (as on sm_70+). Threads
// waiting at different barriers are reported as a deadlock, not hung.
// __shared__ variables are statics, shared by the block that runs.
//
// Arithmetic: f32 as IEEE single with no contraction (-ffp-contract=off);
// glibc's expf/sinf/cosf differ from CUDA's by a few ulp. f16, bf16 and fp8
// e4m3 conversions round to nearest even, as the CUDA intrinsics named.
// mma.sync.m16n8k16 (kernels/gemm.cu) is computed from the PTX ISA's
// fragment layout across the warp's 32 lanes.
#pragma once
#define ENVELOPE_EMU 1

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <csetjmp>
#include <memory>
#include <ucontext.h>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

using std::max;
using std::min;

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

// ---- numbers ---------------------------------------------------------------

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

namespace emu {
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return sign | 0x7e00;  // NaN
  if (ax >= 0x47800000) return sign | 0x7c00;  // >= 65536: inf
  if (ax < 0x38800000) {  // below 2^-14: a subnormal half (units of 2^-24)
    float a;
    std::memcpy(&a, &ax, 4);
    return sign | (uint16_t)std::nearbyint(a * 16777216.0f);
  }
  uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffff) >> 13));
  const uint32_t rest = ax & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;  // a carry may make inf
  return sign | (uint16_t)h;
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float r;
  if (e == 0) {
    r = std::ldexp((float)m, -24);
  } else {
    const uint32_t x = e == 31 ? (0x7f800000 | (m << 13)) : (((e - 15 + 127) << 23) | (m << 13));
    std::memcpy(&r, &x, 4);
  }
  return (h & 0x8000) ? -r : r;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}
inline float bf16_to_f32(uint16_t b) {
  const uint32_t x = (uint32_t)b << 16;
  float r;
  std::memcpy(&r, &x, 4);
  return r;
}
}  // namespace emu

struct __half_raw {
  unsigned short x;
};
struct __half {
  unsigned short x;
  __half() = default;
  __half(float f) : x(emu::f32_to_f16(f)) {}
  __half(__half_raw r) : x(r.x) {}
};
struct __nv_bfloat16 {
  unsigned short x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : x(emu::f32_to_bf16(f)) {}
};
inline float __half2float(__half h) { return emu::f16_to_f32(h.x); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline float __bfloat162float(__nv_bfloat16 b) { return emu::bf16_to_f32(b.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }

// fp8 e4m3 ("fn": no infinities, 0x7f/0xff NaN, largest finite 448).
typedef unsigned char __nv_fp8_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t v, __nv_fp8_interpretation_t) {
  const int e = (v >> 3) & 0xf, m = v & 7;
  float a;
  if (e == 15 && m == 7)
    a = NAN;
  else if (e == 0)
    a = std::ldexp((float)m, -9);
  else
    a = std::ldexp(1.0f + m / 8.0f, e - 7);
  return __half_raw{emu::f32_to_f16((v & 0x80) ? -a : a)};
}
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t, __nv_fp8_interpretation_t) {
  if (std::isnan(x)) return 0x7f;
  const unsigned char sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7e;  // saturate to the largest finite
  if (a < 0.015625f)  // below 2^-6: subnormal, units of 2^-9 (8 is the smallest normal)
    return sign | (unsigned char)std::nearbyint(a * 512.0f);
  int k;
  std::frexp(a, &k);  // a = f 2^k, f in [0.5, 1)
  int e = k - 1;
  int m = (int)std::nearbyint((std::ldexp(a, -e) - 1.0f) * 8.0f);
  if (m == 8) {
    m = 0;
    e++;
  }
  if (e + 7 > 15 || (e + 7 == 15 && m == 7)) return sign | 0x7e;
  return sign | (unsigned char)(((e + 7) << 3) | m);
}

// ---- threads, barriers, warps ----------------------------------------------

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {
enum State { RUN, AT_BLOCK, AT_WARP, DONE };
// A fiber starts through makecontext/swapcontext and then switches with
// _setjmp/_longjmp, which (unlike swapcontext) make no signal-mask system
// call: a block's threads switch at every barrier and shuffle.
struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  bool started;
  State state;
};
// Words each lane can publish to its warp (mma: 4 A + 2 B + 4 C registers).
constexpr int SLOT = 16;
constexpr size_t STACK = 256 << 10;
struct Launch {
  std::vector<Fiber> fibers;
  std::vector<uint32_t> xchg;  // [threads][SLOT]
  ucontext_t sched;
  jmp_buf sched_jb;
  unsigned cur = 0;
  void (*call)(void**) = nullptr;
  void** args = nullptr;
};
inline Launch* L = nullptr;
inline std::mutex launch_lock;
// Fiber stacks, kept from launch to launch (untouched pages cost nothing).
inline std::vector<std::unique_ptr<char[]>> stacks;

inline void yield(State s) {
  Fiber& f = L->fibers[L->cur];
  f.state = s;
  if (!_setjmp(f.jb)) _longjmp(L->sched_jb, 1);
}

// Runs fiber i until it yields.
inline void resume(unsigned i) {
  Fiber& f = L->fibers[i];
  if (_setjmp(L->sched_jb)) return;
  if (!f.started) {
    f.started = true;
    swapcontext(&L->sched, &f.ctx);
  } else {
    _longjmp(f.jb, 1);
  }
}
inline unsigned lane() { return L->cur & 31; }
inline uint32_t* slot(unsigned tid) { return &L->xchg[(size_t)tid * SLOT]; }
inline unsigned warp_base() { return L->cur & ~31u; }

inline void fiber_main() {
  L->call(L->args);
  yield(DONE);  // never resumed
}

// Runs one block to the end. Returns an error message or nullptr.
inline const char* run_block(unsigned n) {
  for (unsigned i = 0; i < n; i++) {
    Fiber& f = L->fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks[i].get();
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    f.started = false;
    f.state = RUN;
  }
  for (;;) {
    for (unsigned i = 0; i < n; i++) {
      if (L->fibers[i].state != RUN) continue;
      L->cur = i;
      threadIdx = uint3{i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
      resume(i);
    }
    bool released = false, alive = false;
    for (unsigned w = 0; w < n; w += 32) {
      bool all = true, any = false;
      for (unsigned i = w; i < std::min(n, w + 32); i++) {
        const State s = L->fibers[i].state;
        if (s == DONE) continue;
        any = true;
        if (s != AT_WARP) all = false;
      }
      if (any && all) {
        for (unsigned i = w; i < std::min(n, w + 32); i++)
          if (L->fibers[i].state == AT_WARP) L->fibers[i].state = RUN;
        released = true;
      }
    }
    if (!released) {
      bool all = true;
      for (unsigned i = 0; i < n; i++) {
        const State s = L->fibers[i].state;
        if (s == DONE) continue;
        alive = true;
        if (s != AT_BLOCK) all = false;
      }
      if (!alive) return nullptr;
      if (!all) return "deadlock: the block's threads wait at different barriers (a __syncthreads or warp operation not reached by all)";
      for (unsigned i = 0; i < n; i++)
        if (L->fibers[i].state == AT_BLOCK) L->fibers[i].state = RUN;
    }
  }
}
}  // namespace emu

inline void __syncthreads() { emu::yield(emu::AT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::yield(emu::AT_WARP); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  const unsigned me = emu::L->cur, base = emu::warp_base();
  std::memcpy(emu::slot(me), &v, 4);
  __syncwarp();
  const unsigned src = ((me - base) ^ (unsigned)lane_mask) & (unsigned)(width - 1);
  const unsigned from = base + (((me - base) & ~(unsigned)(width - 1)) | src);
  T r;
  std::memcpy(&r, emu::slot(from), 4);
  __syncwarp();
  return r;
}

inline unsigned atomicMax(unsigned* p, unsigned v) {
  const unsigned old = *p;
  if (v > old) *p = v;
  return old;
}
inline int atomicMax(int* p, int v) {
  const int old = *p;
  if (v > old) *p = v;
  return old;
}
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: d (this lane's 4 f32) +=
// A[16x16] . B[16x8], with the fragments spread over the warp as the PTX ISA
// lays them out (g = lane / 4, t = lane % 4): a[0] = A[g][2t..2t+1], a[1] =
// A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]; b[0] =
// B[2t..2t+1][g], b[1] = B[2t+8..][g]; d[0..1] = D[g][2t..2t+1], d[2..3] =
// D[g+8][2t..].
template <typename S>
inline void emu_mma_16816(float* d, const unsigned* a, const unsigned* b) {
  const unsigned me = emu::L->cur, base = emu::warp_base();
  uint32_t* s = emu::slot(me);
  std::memcpy(s, a, 16);
  std::memcpy(s + 4, b, 8);
  __syncwarp();
  auto half_of = [](uint32_t reg, int which) -> float {
    const unsigned short bits = (unsigned short)(which ? reg >> 16 : reg & 0xffff);
    if constexpr (std::is_same<S, __half>::value)
      return emu::f16_to_f32(bits);
    else
      return emu::bf16_to_f32(bits);
  };
  auto A = [&](int row, int k) {
    const unsigned owner = base + (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half_of(emu::slot(owner)[reg], k % 2);
  };
  auto B = [&](int k, int col) {
    const unsigned owner = base + col * 4 + (k % 8) / 2;
    return half_of(emu::slot(owner)[4 + (k >= 8 ? 1 : 0)], k % 2);
  };
  const int g = (me - base) / 4, t = (me - base) % 4;
  float out[4];
  for (int f = 0; f < 4; f++) {
    const int row = g + (f >> 1) * 8, col = 2 * t + (f & 1);
    float acc = 0.0f;
    for (int k = 0; k < 16; k++) acc += A(row, k) * B(k, col);
    out[f] = d[f] + acc;
  }
  __syncwarp();
  for (int f = 0; f < 4; f++) d[f] = out[f];
}
inline void mma_16816(float* d, const unsigned* a, const unsigned* b, __half) {
  emu_mma_16816<__half>(d, a, b);
}
inline void mma_16816(float* d, const unsigned* a, const unsigned* b, __nv_bfloat16) {
  emu_mma_16816<__nv_bfloat16>(d, a, b);
}

// ---- launching ---------------------------------------------------------------

// Calls kernel `f` with its arguments from `args` (one pointer per
// parameter, as cuLaunchKernel's kernelParams).
template <typename... A, size_t... I>
inline void emu_call_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <typename... A>
inline void emu_call(void (*f)(A...), void** args) {
  emu_call_impl(f, args, std::index_sequence_for<A...>{});
}
// The byte size of each of `f`'s parameters (for copying launch arguments,
// as the driver does from a kernel's metadata).
template <typename... A>
inline int emu_sizes(void (*)(A...), size_t* out) {
  const size_t s[] = {sizeof(A)..., 0};
  for (size_t i = 0; i < sizeof...(A); i++) out[i] = s[i];
  return (int)sizeof...(A);
}
#define EMU_KERNEL(name)                                                    \
  extern "C" void emu_call_##name(void** args) { emu_call(&name, args); } \
  extern "C" int emu_sizes_##name(size_t* out) { return emu_sizes(&name, out); }

// Runs `call(args)` on every thread of a (grid, block) launch. Returns 0, or
// 1 with a message in err.
extern "C" __attribute__((visibility("default"))) int emu_launch(const unsigned* grid, const unsigned* block, void (*call)(void**),
                                                          void** args, char* err, int err_len) {
  std::lock_guard<std::mutex> guard(emu::launch_lock);
  const unsigned n = block[0] * block[1] * block[2];
  if (n == 0 || n > 1024 || grid[0] * grid[1] * grid[2] == 0) {
    std::snprintf(err, err_len, "bad launch: grid %ux%ux%u, block %ux%ux%u", grid[0], grid[1],
                  grid[2], block[0], block[1], block[2]);
    return 1;
  }
  emu::Launch l;
  l.fibers.resize(n);
  while (emu::stacks.size() < n) emu::stacks.emplace_back(new char[emu::STACK]);
  l.xchg.assign((size_t)n * emu::SLOT, 0);
  l.call = call;
  l.args = args;
  emu::L = &l;
  gridDim = dim3{grid[0], grid[1], grid[2]};
  blockDim = dim3{block[0], block[1], block[2]};
  for (unsigned z = 0; z < grid[2]; z++)
    for (unsigned y = 0; y < grid[1]; y++)
      for (unsigned x = 0; x < grid[0]; x++) {
        blockIdx = uint3{x, y, z};
        if (const char* e = emu::run_block(n)) {
          std::snprintf(err, err_len, "block (%u,%u,%u): %s", x, y, z, e);
          emu::L = nullptr;
          return 1;
        }
      }
  emu::L = nullptr;
  return 0;
}
