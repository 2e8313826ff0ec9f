#!/usr/bin/env bash
# Installs NVIDIA's NVRTC (the run-time CUDA C++ compiler library) and the
# CUDA runtime headers (cuda_fp16.h, cuda_bf16.h, ...) from PyPI into
# .venv-cuda, for the kernel compile check (no GPU, no driver, no toolkit).
# Prints two lines:
#   ENVELOPE_NVRTC_LIB=<path to libnvrtc.so.13>
#   ENVELOPE_CUDA_INCLUDE=<include directory>
#
# Versions are pinned to CUDA 13.0, the toolkit and driver (580) of the H200
# machines: PTX from a newer NVRTC would not load on an older driver.
set -euo pipefail
cd "$(dirname "$0")/.."
NVRTC_VERSION=13.0.88
RUNTIME_VERSION=13.0.96
VENV=.venv-cuda

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" >&2
fi
if ! "$VENV/bin/python" -m pip show nvidia-cuda-nvrtc 2>/dev/null | grep -q "^Version: $NVRTC_VERSION\$" ||
   ! "$VENV/bin/python" -m pip show nvidia-cuda-runtime 2>/dev/null | grep -q "^Version: $RUNTIME_VERSION\$"; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "nvidia-cuda-nvrtc==$NVRTC_VERSION" "nvidia-cuda-runtime==$RUNTIME_VERSION" >&2
fi
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
lib="$site/nvidia/cu13/lib/libnvrtc.so.13"
inc="$site/nvidia/cu13/include"
[ -f "$lib" ] || { echo "nvrtc-setup: $lib missing after install" >&2; exit 1; }
[ -f "$inc/cuda_bf16.h" ] || { echo "nvrtc-setup: $inc/cuda_bf16.h missing after install" >&2; exit 1; }
echo "ENVELOPE_NVRTC_LIB=$(realpath "$lib")"
echo "ENVELOPE_CUDA_INCLUDE=$(realpath "$inc")"
