// A CUDA driver library (libcuda.so.1) for machines without a GPU: it runs
// the kernels on the CPU emulator (emu.h), so the engine's CUDA backend
// itself (cudarc, the runtime, the model's forward, CUDA graphs) runs
// unchanged against it, with LD_LIBRARY_PATH pointing at the folder that
// holds it and ENVELOPE_EMU_DIR at the emulated kernel libraries
// (*.emu.so, built by envelope_cuda::emu). One device, compute capability
// 9.0, 16 GiB reported; "device" memory is host memory; every operation
// runs synchronously in stream order. Modules ignore their PTX: functions
// are found by name among the emulated kernels. Stream capture records
// launches, copies and sets (allocations happen at once, frees during a
// capture are dropped) and a graph launch replays them.
// Only the calls cudarc and envelope make are here; a missing one makes
// cudarc report the missing symbol.
#include <dirent.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define API extern "C" __attribute__((visibility("default")))

enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  NO_DEVICE = 100,
  INVALID_DEVICE = 101,
  INVALID_HANDLE = 400,
  NOT_FOUND = 500,
  LAUNCH_FAILED = 719,
  NOT_SUPPORTED = 801,
};

namespace {
typedef int (*LaunchFn)(const unsigned*, const unsigned*, void (*)(void**), void**, char*, int);
struct Func {
  LaunchFn launch;
  void (*call)(void**);
  int (*sizes)(size_t*);
  std::string name;
};
struct Op {
  enum Kind { LAUNCH, COPY, SET } kind;
  const Func* f = nullptr;
  unsigned grid[3] = {}, block[3] = {};
  std::vector<std::vector<char>> args;
  CUdeviceptr dst = 0;
  const void* src = nullptr;
  size_t bytes = 0;
  unsigned char value = 0;
};
struct Graph {
  std::vector<Op> ops;
};
struct Stream {
  Graph* capture = nullptr;
};

std::recursive_mutex mu;
bool inited = false;
std::vector<void*> libs;
std::map<std::string, Func*> funcs;
std::map<CUdeviceptr, size_t> allocs;
size_t allocated = 0;
const size_t TOTAL = 16ull << 30;
Stream default_stream;
int the_ctx, the_pool, the_module, the_event;

Stream* stream_of(void* s) { return s ? static_cast<Stream*>(s) : &default_stream; }

CUresult run(const Op& op) {
  switch (op.kind) {
    case Op::COPY:
      std::memcpy((void*)op.dst, op.src, op.bytes);
      return OK;
    case Op::SET:
      std::memset((void*)op.dst, op.value, op.bytes);
      return OK;
    case Op::LAUNCH: {
      std::vector<void*> ptrs;
      for (auto& a : op.args) ptrs.push_back((void*)a.data());
      char err[512] = {0};
      if (op.f->launch(op.grid, op.block, op.f->call, ptrs.data(), err, sizeof err)) {
        std::fprintf(stderr, "fake libcuda: %s: %s\n", op.f->name.c_str(), err);
        return LAUNCH_FAILED;
      }
      return OK;
    }
  }
  return INVALID_VALUE;
}

// Runs an operation now, or records it when the stream is capturing.
CUresult submit(void* stream, Op op) {
  Stream* s = stream_of(stream);
  if (s->capture) {
    s->capture->ops.push_back(std::move(op));
    return OK;
  }
  return run(op);
}

CUresult alloc(CUdeviceptr* p, size_t bytes) {
  if (!p) return INVALID_VALUE;
  if (allocated + bytes > TOTAL) return OUT_OF_MEMORY;
  void* m = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (!m) return OUT_OF_MEMORY;
  *p = (CUdeviceptr)m;
  allocs[*p] = bytes;
  allocated += bytes;
  return OK;
}

CUresult release(CUdeviceptr p) {
  auto it = allocs.find(p);
  if (it == allocs.end()) return p ? INVALID_VALUE : OK;
  allocated -= it->second;
  allocs.erase(it);
  std::free((void*)p);
  return OK;
}
}  // namespace

#define LOCK std::lock_guard<std::recursive_mutex> guard(mu)

API CUresult cuInit(unsigned) {
  LOCK;
  if (inited) return OK;
  const char* dir = std::getenv("ENVELOPE_EMU_DIR");
  if (!dir) return NO_DEVICE;
  DIR* d = opendir(dir);
  if (!d) return NO_DEVICE;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() < 7 || n.compare(n.size() - 7, 7, ".emu.so") != 0) continue;
    void* h = dlopen((std::string(dir) + "/" + n).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      std::fprintf(stderr, "fake libcuda: %s\n", dlerror());
      continue;
    }
    libs.push_back(h);
  }
  closedir(d);
  if (libs.empty()) return NO_DEVICE;
  inited = true;
  return OK;
}
API CUresult cuDriverGetVersion(int* v) {
  *v = 13000;
  return OK;
}
API CUresult cuDeviceGetCount(int* n) {
  *n = inited ? 1 : 0;
  return inited ? OK : NOT_INITIALIZED;
}
API CUresult cuDeviceGet(int* d, int ordinal) {
  if (!inited) return NOT_INITIALIZED;
  if (ordinal != 0) return INVALID_DEVICE;
  *d = 0;
  return OK;
}
API CUresult cuDeviceGetName(char* name, int len, int) {
  std::snprintf(name, len, "envelope CPU emulator (no GPU)");
  return OK;
}
API CUresult cuDeviceTotalMem_v2(size_t* b, int) {
  *b = TOTAL;
  return OK;
}
API CUresult cuDeviceGetAttribute(int* v, int attr, int) {
  switch (attr) {
    case 1: *v = 1024; break;    // max threads per block
    case 8: *v = 49152; break;   // shared memory per block
    case 10: *v = 32; break;     // warp size
    case 16: *v = 1; break;      // multiprocessors
    case 75: *v = 9; break;      // compute capability major
    case 76: *v = 0; break;      // minor
    case 115: *v = 1; break;     // memory pools (async allocation)
    default: *v = 0;
  }
  return OK;
}
API CUresult cuDeviceGetUuid(void* u, int) {
  std::memset(u, 0, 16);
  return OK;
}
API CUresult cuDeviceGetUuid_v2(void* u, int) { return cuDeviceGetUuid(u, 0); }
API CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
  *ctx = &the_ctx;
  return OK;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
API CUresult cuCtxSetCurrent(void*) { return OK; }
API CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = &the_ctx;
  return OK;
}
API CUresult cuCtxPushCurrent_v2(void*) { return OK; }
API CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (ctx) *ctx = &the_ctx;
  return OK;
}
API CUresult cuCtxSynchronize() { return OK; }
API CUresult cuGetErrorString(int e, const char** s) {
  static thread_local char buf[64];
  std::snprintf(buf, sizeof buf, "fake libcuda error %d", e);
  *s = buf;
  return OK;
}
API CUresult cuGetErrorName(int e, const char** s) { return cuGetErrorString(e, s); }

// ---- memory ----
API CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
  LOCK;
  *free = TOTAL - allocated;
  *total = TOTAL;
  return OK;
}
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
  LOCK;
  return alloc(p, bytes);
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void*) {
  LOCK;
  return alloc(p, bytes);
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  LOCK;
  return release(p);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, void* stream) {
  LOCK;
  // Memory a captured graph uses must outlive the capture: kept.
  if (stream_of(stream)->capture) return OK;
  return release(p);
}
API CUresult cuDeviceGetDefaultMemPool(void** pool, int) {
  *pool = &the_pool;
  return OK;
}
API CUresult cuMemPoolSetAttribute(void*, int, void*) { return OK; }
API CUresult cuMemPoolTrimTo(void*, size_t) { return OK; }
API CUresult cuDeviceGraphMemTrim(int) { return OK; }

static Op copy(CUdeviceptr dst, const void* src, size_t bytes) {
  Op op{Op::COPY};
  op.dst = dst;
  op.src = src;
  op.bytes = bytes;
  return op;
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  LOCK;
  return run(copy(dst, src, n));
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
  LOCK;
  return submit(s, copy(dst, src, n));
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  LOCK;
  return run(copy((CUdeviceptr)dst, (const void*)src, n));
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
  LOCK;
  return submit(s, copy((CUdeviceptr)dst, (const void*)src, n));
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  LOCK;
  return run(copy(dst, (const void*)src, n));
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
  LOCK;
  return submit(s, copy(dst, (const void*)src, n));
}
static Op set(CUdeviceptr dst, unsigned char v, size_t n) {
  Op op{Op::SET};
  op.dst = dst;
  op.value = v;
  op.bytes = n;
  return op;
}
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
  LOCK;
  return run(set(dst, v, n));
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
  LOCK;
  return submit(s, set(dst, v, n));
}

// ---- streams and events ----
API CUresult cuStreamCreate(void** s, unsigned) {
  *s = new Stream();
  return OK;
}
API CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { return cuStreamCreate(s, 0); }
API CUresult cuStreamDestroy_v2(void* s) {
  delete static_cast<Stream*>(s);
  return OK;
}
API CUresult cuStreamSynchronize(void*) { return OK; }
API CUresult cuStreamQuery(void*) { return OK; }
API CUresult cuStreamWaitEvent(void*, void*, unsigned) { return OK; }
API CUresult cuEventCreate(void** e, unsigned) {
  *e = &the_event;
  return OK;
}
API CUresult cuEventDestroy_v2(void*) { return OK; }
API CUresult cuEventRecord(void*, void*) { return OK; }
API CUresult cuEventRecordWithFlags(void*, void*, unsigned) { return OK; }
API CUresult cuEventSynchronize(void*) { return OK; }
API CUresult cuEventQuery(void*) { return OK; }
API CUresult cuEventElapsedTime(float* ms, void*, void*) {
  *ms = 0.0f;
  return OK;
}
API CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

// ---- modules and launches ----
API CUresult cuModuleLoadData(void** m, const void*) {
  *m = &the_module;
  return OK;
}
API CUresult cuModuleLoadDataEx(void** m, const void* image, unsigned, void*, void*) {
  return cuModuleLoadData(m, image);
}
API CUresult cuModuleUnload(void*) { return OK; }
API CUresult cuModuleGetFunction(void** f, void*, const char* name) {
  LOCK;
  auto it = funcs.find(name);
  if (it == funcs.end()) {
    const std::string call = std::string("emu_call_") + name, sizes = std::string("emu_sizes_") + name;
    for (void* h : libs) {
      void* c = dlsym(h, call.c_str());
      if (!c) continue;
      Func* fn = new Func{(LaunchFn)dlsym(h, "emu_launch"), (void (*)(void**))c,
                          (int (*)(size_t*))dlsym(h, sizes.c_str()), name};
      it = funcs.emplace(name, fn).first;
      break;
    }
    if (it == funcs.end()) return NOT_FOUND;
  }
  *f = it->second;
  return OK;
}
API CUresult cuFuncGetAttribute(int* v, int, void*) {
  *v = 0;
  return OK;
}
API CUresult cuFuncSetAttribute(void*, int, int) { return OK; }
API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  LOCK;
  if (!f || extra || shared) return shared ? NOT_SUPPORTED : INVALID_VALUE;
  const Func* fn = static_cast<const Func*>(f);
  Op op{Op::LAUNCH};
  op.f = fn;
  const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
  std::memcpy(op.grid, g, sizeof g);
  std::memcpy(op.block, b, sizeof b);
  // The argument values are copied (a captured launch runs after the
  // caller's argument storage is gone).
  size_t sizes[64];
  const int n = fn->sizes(sizes);
  for (int i = 0; i < n; i++) {
    const char* p = static_cast<const char*>(params[i]);
    op.args.emplace_back(p, p + sizes[i]);
  }
  return submit(stream, std::move(op));
}

// ---- stream capture and graphs ----
API CUresult cuStreamBeginCapture_v2(void* s, int) {
  LOCK;
  Stream* st = stream_of(s);
  if (st->capture) return INVALID_VALUE;
  st->capture = new Graph();
  return OK;
}
API CUresult cuStreamEndCapture(void* s, void** graph) {
  LOCK;
  Stream* st = stream_of(s);
  if (!st->capture) return INVALID_VALUE;
  *graph = st->capture;
  st->capture = nullptr;
  return OK;
}
API CUresult cuStreamIsCapturing(void* s, int* status) {
  *status = stream_of(s)->capture ? 1 : 0;
  return OK;
}
API CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  (void)mode;
  return OK;
}
API CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
  *exec = graph;
  return OK;
}
API CUresult cuGraphUpload(void*, void*) { return OK; }
API CUresult cuGraphLaunch(void* exec, void* stream) {
  LOCK;
  Graph* g = static_cast<Graph*>(exec);
  if (stream_of(stream)->capture) return NOT_SUPPORTED;
  for (const Op& op : g->ops)
    if (CUresult r = run(op)) return r;
  return OK;
}
API CUresult cuGraphExecDestroy(void*) { return OK; }
API CUresult cuGraphDestroy(void* g) {
  delete static_cast<Graph*>(g);
  return OK;
}
