#!/usr/bin/env bash
# Regenerates kernels/ptx/: the PTX of every kernel in kernels/ for
# compute_80 and compute_90, compiled by the pinned NVRTC wheel
# (scripts/nvrtc-setup.sh) with the options the runtime uses
# (envelope_cuda::compile::options, through envelope_cuda::ptxgen), plus
# kernels/ptx/SOURCES, the SHA-256 of each source it was made from. The binary embeds these files and loads them
# on a machine that has the NVIDIA driver but no NVRTC (no CUDA toolkit).
#
# Run it after editing anything in kernels/. CI fails when the files are
# stale: the digests are checked on every machine, and where NVRTC is
# installed each file must equal NVRTC's output byte for byte
# (crates/envelope-cuda/tests/it/nvrtc_compile.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(bash scripts/nvrtc-setup.sh)"
export ENVELOPE_NVRTC_LIB ENVELOPE_CUDA_INCLUDE
# The generator is envelope_cuda::ptxgen: the runtime's NVRTC bindings and
# compile options, so the PTX is what the runtime would compile.
cargo run --release --quiet -p envelope-cuda --example gen_ptx -- kernels
