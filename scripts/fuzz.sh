#!/usr/bin/env bash
# Runs the governor's cargo-fuzz targets (fuzz/fuzz_targets: request
# validation, token counting, the SSE relay), each for SECONDS (default 30),
# from the committed seeds (fuzz/seeds) and a corpus kept under
# fuzz/corpus (not committed). Installs cargo-fuzz from crates.io when it
# is missing. Builds on the stable toolchain: no sanitizer (-s none), so a
# finding is a failed assertion or a panic, which libFuzzer reports with
# the input it saved under fuzz/artifacts. Prints one line per target.
#
#   scripts/fuzz.sh [--dev] [--build-only] [SECONDS] [TARGET...]
#
# --dev builds without optimisation and with debug assertions (integer
# overflow checks included): it builds in well under half the time of the
# optimised build and runs about a tenth as many inputs a second. CI uses it
# for its short runs; the long runs (`scripts/fuzz.sh 600`) are optimised.
# --build-only builds the targets and runs nothing (CI builds them while the
# Rust tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=(-O)
build_only=false
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) mode=(--dev); shift ;;
    --build-only) build_only=true; shift ;;
    *) break ;;
  esac
done
secs="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=(request counting sse_relay); fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi
cd fuzz
cargo fuzz build -s none "${mode[@]}" >/dev/null
if $build_only; then
  exit 0
fi
for t in "${targets[@]}"; do
  seeds=seeds/$t
  [ -d "$seeds" ] || seeds=seeds/request
  mkdir -p "corpus/$t"
  log=$(mktemp)
  if ! cargo fuzz run -s none "${mode[@]}" "$t" "corpus/$t" "$seeds" -- -max_total_time="$secs" >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: $t FAILED (input saved under fuzz/artifacts/$t)" >&2
    exit 1
  fi
  echo "fuzz: $t: $(grep -E '^Done [0-9]+ runs' "$log") ($(grep -E 'DONE' "$log" | grep -oE 'cov: [0-9]+|corp: [0-9]+/[0-9a-zA-Z]+' | tr '\n' ' '))"
  rm -f "$log"
done
