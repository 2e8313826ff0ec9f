#!/usr/bin/env bash
# The prepared GPU check of issue #7, for a machine with an NVIDIA driver
# (R580+, CUDA 13.0): it needs the release binary and nothing else. No CUDA
# toolkit: without NVRTC the kernels load from the PTX embedded in the binary
# and without cuBLAS the GEMMs run on kernels/gemm.cu (where the toolkit or
# NVIDIA's pip wheels are installed they are used, and the driver-only stage
# switches them off to check the other path). No build tools, no network, no
# model files: the models are `dummy:` presets generated on the device. Run
# from the repository root:
#
#   scripts/device-check.sh [OUT] [STAGES]   # OUT defaults to $OUT, else device-check-out
#                                            # STAGES: comma list of kernels,driver-only,gemm,models,engine,bench (default: all)
#
# Nothing here has run on a GPU yet, so the real durations are unknown. Each
# stage has a timeout (below), so a hang costs at most that: kernels 120 s,
# kernel-cache 30 s, driver-only 60 + 120 s, gemm 90 s, models 180 s, engine
# 90 + 30 s, bench 300 s (1020 s in all). A device call is limited to 600 s:
# run it in two calls, `kernels,driver-only,models` and then
# `gemm,engine,bench`.
# Stages:
#   kernels  `envelope cuda-selftest`: device and NVML facts, every kernel in
#            kernels/ compiled by the machine's NVRTC (libnvrtc.so.13 from the
#            toolkit or a pip wheel) or, without one, taken from the PTX
#            embedded in the binary, and run on seeded random inputs against
#            its CPU reference (tolerances per dtype in
#            crates/envelope-cuda/src/selftest.rs) -> OUT/selftest.json; then
#            a second run whose NVRTC compiles must come from the kernel cache.
#   driver-only  the same self-test, then the model check of dummy:smollm2-135m,
#            with ENVELOPE_KERNELS=embedded ENVELOPE_GEMM=kernels: NVRTC and
#            cuBLAS are not opened, as on a machine with only the driver ->
#            OUT/driver-only/.
#   gemm     `cuda-selftest --gemm-bench`: cuBLAS/cuBLASLt against
#            kernels/gemm.cu on Llama 3.1 8B's layer shapes in bf16 and fp8 at
#            1, 8, 64, 512 and 4096 rows -> OUT/gemm-bench.json and .csv.
#   models   `cuda-selftest --models`: dummy:smollm2-135m and dummy:llama-3.2-1b
#            on the GPU against the CPU engine on this machine, in f32, bf16 and
#            fp8 (against the CPU's fp8 emulation): last-token logits and 8
#            greedy tokens -> OUT/model-check.json.
#   engine   `bench-engine --device cuda` on dummy:llama-3.2-1b through the
#            whole engine (scheduler, paged KV, sampling), and `--device auto`.
#   bench    `cuda-selftest --bench`: dummy:llama-3.1-8b in bf16 and fp8, prefill
#            and decode tokens/s at batch 1/8/64 and context 1k/8k, decode both
#            eagerly and from CUDA graphs, weight bytes against the analytic
#            size and NVML -> OUT/bench-cuda.json and .csv.
# Everything printed is also in OUT/device-check.log. Exit status: 0 only when
# every stage run passed.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${ENVELOPE_BIN:-target/release/envelope}
DEST=${1:-${OUT:-device-check-out}}
STAGES=${2:-kernels,driver-only,gemm,models,engine,bench}
mkdir -p "$DEST"
# A fresh kernel cache, so the run measures the compile too.
export ENVELOPE_KERNEL_CACHE=$(mktemp -d)
export ENVELOPE_LOG=${ENVELOPE_LOG:-warn}
LOG="$DEST/device-check.log"
status=0

if [ ! -x "$BIN" ]; then
  echo "device-check: $BIN is missing (build it with cargo build --release and carry it)" | tee "$LOG"
  exit 2
fi

want() { [[ ",$STAGES," == *",$1,"* ]]; }
for s in ${STAGES//,/ }; do
  case "$s" in
    kernels | driver-only | gemm | models | engine | bench) ;;
    *)
      echo "device-check: unknown stage '$s' (kernels, driver-only, gemm, models, engine, bench)" | tee -a "$LOG"
      exit 2
      ;;
  esac
done

# run NAME TIMEOUT CMD...: runs a stage, logs it, records a failure.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  case "$rc" in 124 | 137) echo "$name: killed after $limit s" | tee -a "$LOG" ;; esac
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" = 0 ] || status=1
  return 0
}

{
  echo "== machine"
  date -u
  uname -srm
  "$BIN" --version
  nproc
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
  else
    echo "nvidia-smi: not on PATH"
  fi
  echo "ENVELOPE_KERNEL_CACHE=$ENVELOPE_KERNEL_CACHE"
} 2>&1 | tee "$LOG"

if want kernels; then
  run kernels 120 "$BIN" cuda-selftest --out "$DEST"
  run kernel-cache 30 "$BIN" cuda-selftest --out "$DEST/second-run"
  # Only NVRTC compiles are cached (embedded PTX needs no compile).
  if grep -q '"kernels": "nvrtc' "$DEST/second-run/selftest.json" 2>/dev/null &&
    grep -q '"from_cache": false' "$DEST/second-run/selftest.json"; then
    echo "kernel-cache: some compiles of the second run did not come from the cache" | tee -a "$LOG"
    status=1
  fi
fi

if want driver-only; then
  only=(env ENVELOPE_KERNELS=embedded ENVELOPE_GEMM=kernels)
  run driver-only-kernels 60 "${only[@]}" "$BIN" cuda-selftest --out "$DEST/driver-only"
  run driver-only-models 120 "${only[@]}" "$BIN" cuda-selftest --models \
    --check-models dummy:smollm2-135m --out "$DEST/driver-only"
fi

if want gemm; then
  run gemm 90 "$BIN" cuda-selftest --gemm-bench --out "$DEST"
fi

if want models; then
  run models 180 "$BIN" cuda-selftest --models --out "$DEST"
fi

if want engine; then
  run engine-cuda 90 "$BIN" bench-engine --device cuda --model dummy:llama-3.2-1b \
    --precision bf16 --prompt-tokens 512 --decode-tokens 32 --decode-prompt-tokens 128 \
    --concurrency 1,8,64 --kv-cache-bytes 8GiB --json
  run engine-auto 30 "$BIN" bench-engine --device auto --model dummy:smollm2-135m \
    --prompt-tokens 64 --decode-tokens 8 --decode-prompt-tokens 16 --concurrency 1 \
    --kv-cache-bytes 256MiB
fi

if want bench; then
  run bench 300 "$BIN" cuda-selftest --bench --out "$DEST"
fi

rm -rf "$ENVELOPE_KERNEL_CACHE"
echo "== device-check exit status $status; results in $DEST" | tee -a "$LOG"
exit "$status"
