#!/usr/bin/env bash
# Regenerates kernels/ptx/: the PTX of every kernel in kernels/ for
# compute_80 and compute_90, compiled by the pinned NVRTC wheel
# (scripts/nvrtc-setup.sh) with the options the runtime uses
# (envelope_cuda::compile::options), plus kernels/ptx/SOURCES, the SHA-256 of
# each source it was made from. The binary embeds these files and loads them
# on a machine that has the NVIDIA driver but no NVRTC (no CUDA toolkit).
#
# Run it after editing anything in kernels/. CI fails when the files are
# stale: the digests are checked on every machine, and where NVRTC is
# installed each file must equal NVRTC's output byte for byte
# (crates/envelope-cuda/tests/nvrtc_compile.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/nvrtc-setup.sh)"
export ENVELOPE_NVRTC_LIB ENVELOPE_CUDA_INCLUDE
LD_LIBRARY_PATH="$(dirname "$ENVELOPE_NVRTC_LIB")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  .venv-cuda/bin/python - <<'PY'
import ctypes, glob, hashlib, os, sys

nvrtc = ctypes.CDLL(os.environ["ENVELOPE_NVRTC_LIB"])
include = os.environ["ENVELOPE_CUDA_INCLUDE"]
major, minor = ctypes.c_int(), ctypes.c_int()
nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
headers = ["common.cuh"]
header_text = [open(f"kernels/{h}", "rb").read() for h in headers]
archs = ["compute_80", "compute_90"]
sources = sorted(os.path.basename(p) for p in glob.glob("kernels/*.cu"))
for old in glob.glob("kernels/ptx/*.ptx"):
    os.remove(old)
manifest = [
    "# The sources kernels/ptx/*.ptx were compiled from (SHA-256), by",
    f"# scripts/gen-ptx.sh with NVRTC {major.value}.{minor.value}. Do not edit: rerun the script.",
]
for name, text in zip(headers, header_text):
    manifest.append(f"{name} {hashlib.sha256(text).hexdigest()}")
for name in sources:
    src = open(f"kernels/{name}", "rb").read()
    manifest.append(f"{name} {hashlib.sha256(src).hexdigest()}")
    for arch in archs:
        prog = ctypes.c_void_p()
        hs = (ctypes.c_char_p * len(headers))(*header_text)
        hn = (ctypes.c_char_p * len(headers))(*[h.encode() for h in headers])
        rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), len(headers), hs, hn)
        assert rc == 0, f"nvrtcCreateProgram {name}: {rc}"
        opts = [f"--gpu-architecture={arch}", "--std=c++17", f"--include-path={include}"]
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
        if rc != 0:
            n = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            sys.exit(f"{name} ({arch}) does not compile:\n{log.value.decode()}")
        n = ctypes.c_size_t()
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        stem = name[: -len(".cu")]
        with open(f"kernels/ptx/{stem}.{arch}.ptx", "wb") as f:
            f.write(ptx.value)
        print(f"kernels/ptx/{stem}.{arch}.ptx: {len(ptx.value)} bytes")
with open("kernels/ptx/SOURCES", "w") as f:
    f.write("\n".join(manifest) + "\n")
PY
