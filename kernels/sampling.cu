// Token selection on the device, one block of SAMPLE_THREADS per row of
// logits [rows, vocab].
//   argmax: the largest logit, the lowest index on a tie (as the CPU engine).
//   sample: per row, params[3 row ..] = (temperature, top_p, u). A
//   temperature <= 0 is argmax. Otherwise softmax(logits / temperature),
//   keep the smallest-by-value set whose mass reaches top_p by bisecting a
//   probability threshold (32 steps, no sort; none when top_p >= 1), then pick where u * kept_mass
//   falls in the kept tokens' cumulative sum in index order. u in [0, 1)
//   comes from the sequence's seeded generator on the host.
//   envelope_cuda::reference::top_p_sample is the same algorithm on the CPU.
#include "common.cuh"

#define SAMPLE_THREADS 256
#define TOPP_STEPS 32

__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float t = lane < (int)(blockDim.x >> 5) ? partial[lane] : -INFINITY;
  return warp_max(t);
}

template <typename T>
__device__ void argmax(const T* logits, u32* out, int vocab) {
  __shared__ float s_v[SAMPLE_THREADS];
  __shared__ int s_i[SAMPLE_THREADS];
  const T* row = logits + (size_t)blockIdx.x * vocab;
  float best = -INFINITY;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = to_f32(row[i]);
    if (v > best) { best = v; bi = i; }  // strided walk: first hit is the lowest index
  }
  s_v[threadIdx.x] = best;
  s_i[threadIdx.x] = bi;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if ((int)threadIdx.x < o) {
      const float v = s_v[threadIdx.x + o];
      const int j = s_i[threadIdx.x + o];
      if (v > s_v[threadIdx.x] || (v == s_v[threadIdx.x] && j < s_i[threadIdx.x])) {
        s_v[threadIdx.x] = v;
        s_i[threadIdx.x] = j;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = s_i[0] == 0x7fffffff ? 0u : (u32)s_i[0];
}

template <typename T>
__device__ void top_p_sample(const T* logits, u32* out, int vocab, float temperature, float top_p,
                             float u) {
  __shared__ float s_chunk[SAMPLE_THREADS];
  const T* row = logits + (size_t)blockIdx.x * vocab;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, to_f32(row[i]));
  mx = block_max(mx);
  const float inv_t = 1.0f / temperature;
  float z = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) z += expf((to_f32(row[i]) - mx) * inv_t);
  z = block_sum(z);
  // Bisect tau in [0, 1] (weights e_i in (0, 1], the largest is 1):
  // invariant S(lo) = sum of e_i >= lo is at least top_p * z. top_p >= 1
  // keeps every token (tau = 0) without the passes.
  float lo = 0.0f, hi = 1.0f;
  const float need = top_p * z;
  for (int step = 0; step < TOPP_STEPS && top_p < 1.0f; step++) {
    const float mid = 0.5f * (lo + hi);
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float e = expf((to_f32(row[i]) - mx) * inv_t);
      if (e >= mid) s += e;
    }
    s = block_sum(s);
    if (s >= need) lo = mid; else hi = mid;
  }
  // Kept mass per contiguous chunk, then a serial walk over the chunks.
  __shared__ int s_last[SAMPLE_THREADS];
  const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int c0 = threadIdx.x * chunk, c1 = min(vocab, c0 + chunk);
  float mine = 0.0f;
  int my_last = -1;
  for (int i = c0; i < c1; i++) {
    const float e = expf((to_f32(row[i]) - mx) * inv_t);
    // The fallback token (a walk that rounding kept short of the target)
    // must have weight: with tau = 0 every token passes e >= lo.
    if (e >= lo) { mine += e; if (e > 0.0f) my_last = i; }
  }
  s_chunk[threadIdx.x] = mine;
  s_last[threadIdx.x] = my_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    float kept = 0.0f;
    int last = 0;
    for (int t = 0; t < (int)blockDim.x; t++) {
      kept += s_chunk[t];
      if (s_last[t] >= 0) last = s_last[t];
    }
    const float target = u * kept;
    float cum = 0.0f;
    int pick = -1;
    for (int t = 0; t < (int)blockDim.x && pick < 0; t++) {
      if (s_chunk[t] <= 0.0f) continue;
      if (cum + s_chunk[t] <= target) { cum += s_chunk[t]; continue; }
      for (int i = t * chunk; i < min(vocab, t * chunk + chunk); i++) {
        const float e = expf((to_f32(row[i]) - mx) * inv_t);
        if (e < lo) continue;
        cum += e;
        if (cum > target) { pick = i; break; }
      }
    }
    out[blockIdx.x] = (u32)(pick >= 0 ? pick : last);
  }
}

extern "C" __global__ void argmax_f32(const float* x, u32* o, int v) { argmax(x, o, v); }
extern "C" __global__ void argmax_f16(const __half* x, u32* o, int v) { argmax(x, o, v); }
extern "C" __global__ void argmax_bf16(const __nv_bfloat16* x, u32* o, int v) { argmax(x, o, v); }
// The branch is uniform over the block (one row), so the barriers inside
// either function are reached by every thread.
template <typename T>
__device__ void sample(const T* logits, u32* out, int vocab, const float* params) {
  const float* p = params + 3 * blockIdx.x;
  if (p[0] <= 0.0f)
    argmax(logits, out, vocab);
  else
    top_p_sample(logits, out, vocab, p[0], p[1], p[2]);
}

extern "C" __global__ void sample_f32(const float* x, u32* o, int v, const float* p) { sample(x, o, v, p); }
extern "C" __global__ void sample_f16(const __half* x, u32* o, int v, const float* p) { sample(x, o, v, p); }
extern "C" __global__ void sample_bf16(const __nv_bfloat16* x, u32* o, int v, const float* p) { sample(x, o, v, p); }
