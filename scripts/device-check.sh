#!/usr/bin/env bash
# The prepared GPU check, for a machine with an NVIDIA driver
# (R580+, CUDA 13.0): it needs the release binary and nothing else. No CUDA
# toolkit: without NVRTC the kernels load from the PTX embedded in the binary
# and without cuBLAS the GEMMs run on kernels/gemm.cu (where the toolkit or
# NVIDIA's pip wheels are installed they are used, and the driver-only stage
# switches them off to check the other path). No build tools, no network, no
# model files: the models are `dummy:` presets generated on the device. Run
# from the repository root:
#
#   scripts/device-check.sh [--bundle] [OUT] [STAGES]
#       OUT     defaults to $OUT, else device-check-out
#       STAGES  comma list, run in the order given; default (most wanted
#               first): kernels,models,bench,driver-only,gemm,engine
#   DEVICE_CHECK_BUDGET=S   stop starting stages after S seconds: each stage's
#               timeout is cut to what is left (less 10 s to pack the
#               results), a stage with under 20 s left is skipped and logged
#   --bundle    the stages write into a scratch folder, and OUT holds only
#               device-check.log and device-check.tar.gz (all the results),
#               the archive refreshed after every stage, so a run killed
#               part-way still returns what finished. For a machine that
#               returns few files (the lent device machine returns 8).
#   DEVICE_CHECK_STAGE_LIMITS=off   no stage timeouts: for the CPU emulator
#               in CI, where the host's speed, not a GPU's, sets how long a
#               stage takes, so a fixed limit would fail a slower machine.
#               A budget still skips the stages that no longer fit.
#
# Nothing here has run on a GPU yet, so the real durations are unknown. Each
# stage has a timeout (below), so a hang costs at most that: kernels 120 s,
# kernel-cache 30 s, models 180 s, bench 300 s, driver-only 60 + 120 s, gemm
# 90 s, engine 90 + 30 s (1020 s in all). On the lent device machine (15
# minutes of device time per session, 600 s per call, start-up included) run
# it once, within a budget that leaves room for one short rerun:
#   run(command: "DEVICE_CHECK_BUDGET=420 scripts/device-check.sh --bundle $OUT",
#       carry: ["target/release/envelope"], timeout_s: 450)
# The bench and GEMM stages print and write (CSV) each point as it is
# measured, so a stage cut by its timeout keeps the points it reached.
# Stages:
#   kernels  `envelope cuda-selftest`: device and NVML facts, every kernel in
#            kernels/ compiled by the machine's NVRTC (libnvrtc.so.13 from the
#            toolkit or a pip wheel) or, without one, taken from the PTX
#            embedded in the binary, and run on seeded random inputs against
#            its CPU reference (tolerances per dtype in
#            crates/envelope-cuda/src/selftest/check.rs) -> OUT/selftest.json; then
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
# Everything printed is also in OUT/device-check.log, which ends with a table
# of the stages (exit status and seconds). Exit status: 0 when every stage
# ran and passed, 1 when one failed, 2 for bad arguments or a missing
# binary, 3 when none failed but the budget skipped some.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${ENVELOPE_BIN:-target/release/envelope}
bundle=0
if [ "${1:-}" = "--bundle" ]; then
  bundle=1
  shift
fi
DEST=${1:-${OUT:-device-check-out}}
STAGES=${2:-kernels,models,bench,driver-only,gemm,engine}
BUDGET=${DEVICE_CHECK_BUDGET:-}
LIMITS=${DEVICE_CHECK_STAGE_LIMITS:-on}
mkdir -p "$DEST"
LOG="$DEST/device-check.log"
: >"$LOG"
case "$LIMITS" in
  on | off) ;;
  *)
    echo "device-check: DEVICE_CHECK_STAGE_LIMITS must be on or off, not '$LIMITS'" | tee -a "$LOG"
    exit 2
    ;;
esac
if [ -n "$BUDGET" ] && ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
  echo "device-check: DEVICE_CHECK_BUDGET must be a whole number of seconds, not '$BUDGET'" | tee -a "$LOG"
  exit 2
fi
for s in ${STAGES//,/ }; do
  case "$s" in
    kernels | driver-only | gemm | models | engine | bench) ;;
    *)
      echo "device-check: unknown stage '$s' (kernels, driver-only, gemm, models, engine, bench)" | tee -a "$LOG"
      exit 2
      ;;
  esac
done
if [ ! -x "$BIN" ]; then
  echo "device-check: $BIN is missing (build it with cargo build --release and carry it)" | tee -a "$LOG"
  exit 2
fi

# Where the stages write: OUT itself, or with --bundle a scratch folder
# packed into OUT/device-check.tar.gz after every stage.
if [ "$bundle" = 1 ]; then
  RES=$(mktemp -d)
else
  RES=$DEST
fi
# A fresh kernel cache, so the run measures the compile too.
export ENVELOPE_KERNEL_CACHE=$(mktemp -d)
export ENVELOPE_LOG=${ENVELOPE_LOG:-warn}
status=0
skipped=0
summary=()

pack() {
  [ "$bundle" = 1 ] || return 0
  cp "$LOG" "$RES/device-check.log"
  tar -czf "$DEST/.device-check.tar.gz" -C "$RES" . && mv "$DEST/.device-check.tar.gz" "$DEST/device-check.tar.gz"
}

# run NAME TIMEOUT CMD...: runs a stage under its timeout (cut to the
# budget), logs it, records a failure or a skip, packs the results.
run() {
  local name=$1 limit=$2
  shift 2
  if [ -n "$BUDGET" ]; then
    local left=$((BUDGET - SECONDS - 10))
    if [ "$left" -lt 20 ]; then
      echo "== $name: skipped, ${left} s of the ${BUDGET} s budget left" | tee -a "$LOG"
      summary+=("$(printf '%-22s %8s %6s' "$name" skipped -)")
      skipped=1
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS rc
  if [ "$LIMITS" = off ]; then
    echo "== $name (no limit): $*" | tee -a "$LOG"
    "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
  else
    echo "== $name (limit $limit s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
  fi
  case "$rc" in 124 | 137) echo "$name: killed after $limit s" | tee -a "$LOG" ;; esac
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  summary+=("$(printf '%-22s %8s %6s' "$name" "exit $rc" "$((SECONDS - t0))")")
  [ "$rc" = 0 ] || status=1
  pack
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
  echo "stages: $STAGES; budget: ${BUDGET:-none}; stage limits: $LIMITS; results: $RES"
  echo "ENVELOPE_KERNEL_CACHE=$ENVELOPE_KERNEL_CACHE"
} 2>&1 | tee -a "$LOG"

for stage in ${STAGES//,/ }; do
  case "$stage" in
    kernels)
      run kernels 120 "$BIN" cuda-selftest --out "$RES"
      run kernel-cache 30 "$BIN" cuda-selftest --out "$RES/second-run"
      # Only NVRTC compiles are cached (embedded PTX needs no compile).
      if grep -q '"kernels": "nvrtc' "$RES/second-run/selftest.json" 2>/dev/null &&
        grep -q '"from_cache": false' "$RES/second-run/selftest.json"; then
        echo "kernel-cache: some compiles of the second run did not come from the cache" | tee -a "$LOG"
        status=1
      fi
      ;;
    driver-only)
      only=(env ENVELOPE_KERNELS=embedded ENVELOPE_GEMM=kernels)
      run driver-only-kernels 60 "${only[@]}" "$BIN" cuda-selftest --out "$RES/driver-only"
      run driver-only-models 120 "${only[@]}" "$BIN" cuda-selftest --models \
        --check-models dummy:smollm2-135m --out "$RES/driver-only"
      ;;
    gemm)
      run gemm 90 "$BIN" cuda-selftest --gemm-bench --out "$RES"
      ;;
    models)
      run models 180 "$BIN" cuda-selftest --models --out "$RES"
      ;;
    engine)
      run engine-cuda 90 "$BIN" bench-engine --device cuda --model dummy:llama-3.2-1b \
        --precision bf16 --prompt-tokens 512 --decode-tokens 32 --decode-prompt-tokens 128 \
        --concurrency 1,8,64 --kv-cache-bytes 8GiB --json
      run engine-auto 30 "$BIN" bench-engine --device auto --model dummy:smollm2-135m \
        --prompt-tokens 64 --decode-tokens 8 --decode-prompt-tokens 16 --concurrency 1 \
        --kv-cache-bytes 256MiB
      ;;
    bench)
      run bench 300 "$BIN" cuda-selftest --bench --out "$RES"
      ;;
  esac
done

rm -rf "$ENVELOPE_KERNEL_CACHE"
[ "$status" = 0 ] && [ "$skipped" = 1 ] && status=3
{
  echo "== stages                 status      s"
  printf '%s\n' "${summary[@]}"
  if [ "$bundle" = 1 ]; then
    echo "== device-check exit status $status in $SECONDS s; results in $DEST/device-check.tar.gz"
  else
    echo "== device-check exit status $status in $SECONDS s; results in $RES"
  fi
} | tee -a "$LOG"
pack
[ "$bundle" = 1 ] && rm -rf "$RES"
exit "$status"
