#!/usr/bin/env bash
# Envelope's sweep beside two peer harnesses from PyPI on one llama.cpp
# llama-server (-np 4 -c 4096 --metrics, loopback): each searches the highest
# concurrency whose TTFT p95 stays within 4000 ms, on the same workload
# (streaming /v1/completions, 256-token prompts, 32 output tokens with
# ignore_eos, concurrency 1..8), one tool after the other on the same server:
#   - envelope sweep (http target; its defaults, sequential test at 0.9
#     confidence and headroom 0.1, but max_client_gap_ms = 1000 as in
#     bench-configs/launch-llama-server.toml);
#   - AIPerf (NVIDIA, PyPI aiperf) `profile --search-recipe
#     max-concurrency-under-sla --search-style monotonic`: doubling, then
#     bisection, each level run until two runs agree (its stability window),
#     each of --request-count requests, passed when its TTFT p95 < 4000 ms;
#   - GuideLLM (PyPI guidellm) `run --profile kind=goodput`: doubling from 1,
#     then bisection, each level one run of max_requests requests, passed
#     when >= 95% of requests have TTFT <= 4000 ms.
# Prints a Markdown table (scripts/vs-peer-harness.py): the concurrency each
# calls acceptable, the TTFT p95 and e2e p50 it reports there, the requests it
# sent in all and its wall time; then every level each probed. A tool that
# fails gets "failed (see log)" in its row; the others still run. Raw output
# of every tool stays in OUT (logs, envelope's profile.json and CSVs, AIPerf's
# search_history.json and per-run exports, GuideLLM's benchmarks.json).
#
#   scripts/vs-peer-harness.sh [--out DIR] [--requests N] [--tools envelope,aiperf,guidellm]
#
# --requests: requests per probed level for the peers (default 48; envelope
# decides its own). Makes what it needs: the model (scripts/fetch-model.sh),
# the release binary (ENVELOPE_BIN, default target/release/envelope),
# llama-server and the SmolLM2 tokenizer folder (scripts/foreign-servers.sh
# --only llama-server / --only vllm, the latter installing vLLM's CPU build
# the first time; skipped when ENVELOPE_LLAMA_SERVER / ENVELOPE_VLLM_MODEL
# are set), and one pinned venv per peer in
# ${ENVELOPE_CACHE:-~/.cache/envelope}/peer-harness/. On the 2-core AMD
# EPYC: envelope 86 s, GuideLLM 350 s, AIPerf 679 s (it runs each level
# twice); docs/measurements/2026-12-06-vs-peer-harness.md.
# A measurement, not a test: not in CI; figures move with what else runs.
set -euo pipefail
cd "$(dirname "$0")/.."

AIPERF_VERSION=0.13.0
GUIDELLM_VERSION=0.8.1
OUT=/tmp/vs-peer-harness-$(date +%s)
REQUESTS=48
TOOLS=envelope,aiperf,guidellm
TTFT_SLO_MS=4000
CONC_MAX=8
STEP_TIMEOUT_S=${VS_PEER_STEP_TIMEOUT_S:-3600}   # per tool (SIGTERM, then SIGKILL 30 s later)
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --tools) TOOLS=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "vs-peer-harness: unknown argument: $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

MODEL=$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf
ENVELOPE=${ENVELOPE_BIN:-target/release/envelope}
bash scripts/fetch-model.sh >&2
case ",$TOOLS," in *,envelope,*) [ -x "$ENVELOPE" ] || cargo build --release --locked >&2 ;; esac
[ -n "${ENVELOPE_LLAMA_SERVER:-}" ] || eval "$(bash scripts/foreign-servers.sh --only llama-server)"
# The SmolLM2 folder converted for vLLM holds tokenizer.json and
# tokenizer_config.json: both peers load it as their HF tokenizer.
[ -n "${ENVELOPE_VLLM_MODEL:-}" ] || eval "$(bash scripts/foreign-servers.sh --only vllm)"
TOKENIZER=$ENVELOPE_VLLM_MODEL

# One venv per peer, pinned; reused when its CLI is there.
PEERS=${ENVELOPE_CACHE:-$HOME/.cache/envelope}/peer-harness
peer_venv() {
  local dir=$PEERS/$1-$2
  if [ ! -x "$dir/bin/$1" ]; then
    echo "vs-peer-harness: installing $1==$2 into $dir" >&2
    [ -x "$dir/bin/python" ] || python3 -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$1==$2" >&2
  fi
  echo "$dir"
}
case ",$TOOLS," in *,aiperf,*) AIPERF=$(peer_venv aiperf "$AIPERF_VERSION") ;; esac
case ",$TOOLS," in *,guidellm,*) GUIDELLM=$(peer_venv guidellm "$GUIDELLM_VERSION") ;; esac

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
BASE=http://127.0.0.1:$PORT
"$ENVELOPE_LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -np 4 -c 4096 --metrics \
  >"$OUT/llama-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  curl -fsS "$BASE/health" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { echo "llama-server exited; see $OUT/llama-server.log" >&2; exit 1; }
  sleep 0.5
done
curl -fsS "$BASE/health" >/dev/null || { echo "llama-server not ready after 120 s" >&2; exit 1; }
echo "== llama-server on $BASE ($("$ENVELOPE_LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || true)); out: $OUT" >&2

# step NAME CMD...: runs CMD with its output in OUT/NAME.log and writes
# "exit-status wall-seconds" to OUT/NAME.status; never fails the script.
step() {
  local name=$1; shift
  printf '%q ' "$@" >"$OUT/$name.cmd"; echo >>"$OUT/$name.cmd"
  echo "== $name: $(cat "$OUT/$name.cmd")" >&2
  local t0=$EPOCHREALTIME rc=0
  timeout --foreground --kill-after=30 "$STEP_TIMEOUT_S" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local t1=$EPOCHREALTIME
  echo "$rc $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" >"$OUT/$name.status"
  echo "   exit $rc, $(cut -d' ' -f2 "$OUT/$name.status") s" >&2
}

# Peers load the tokenizer from the local folder only.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

for tool in ${TOOLS//,/ }; do
  case "$tool" in
    envelope)
      # max_client_gap_ms as in bench-configs/launch-llama-server.toml: on 2
      # cores llama-server starves the client, and a probe whose workers
      # idle over the default 100 ms is client-limited and cannot pass.
      cat >"$OUT/envelope.toml" <<EOF
[target]
kind = "http"
base_url = "$BASE"
model = "smollm2"

[matrix]
buckets = ["256x32"]
concurrency_max = $CONC_MAX

[load]
max_client_gap_ms = 1000

[slo]
ttft_p95_ms = $TTFT_SLO_MS
EOF
      step envelope "$ENVELOPE" sweep --config "$OUT/envelope.toml" --out "$OUT/envelope" ;;
    aiperf)
      # Not offline: aiperf 0.13.0 in offline mode looks every tokenizer
      # name up in the Hub's cache (snapshot_download), a local folder too,
      # and fails ("Repo id must be in the form ..."); online, a local
      # folder loads straight from disk.
      step aiperf env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$AIPERF/bin/aiperf" profile \
        --model smollm2 --url "$BASE" --endpoint-type completions --streaming \
        --isl 256 --isl-stddev 0 --osl 32 --osl-stddev 0 --extra-inputs ignore_eos:true \
        --tokenizer "$TOKENIZER" --random-seed 42 \
        --search-recipe max-concurrency-under-sla --search-style monotonic \
        --ttft-sla-ms "$TTFT_SLO_MS" --concurrency-min 1 --concurrency-max "$CONC_MAX" \
        --request-count "$REQUESTS" \
        --ui none --no-gpu-telemetry --no-server-metrics --workers-max 1 --record-processors 1 \
        --output-artifact-dir "$OUT/aiperf" ;;
    guidellm)
      mkdir -p "$OUT/guidellm"
      # One worker process (default: one per stream, up to 10), as AIPerf's
      # --workers-max 1. It sends ignore_eos itself when output_tokens is set.
      step guidellm env GUIDELLM__MAX_WORKER_PROCESSES=1 "$GUIDELLM/bin/guidellm" run \
        --backend "kind=openai_http,target=$BASE,model=smollm2,request_format=/v1/completions,stream=true" \
        --profile "kind=goodput,initial_streams=1,max_streams=$CONC_MAX,target_attainment=0.95" \
        --metrics "kind=generative,slo.ttft_ms=$TTFT_SLO_MS" \
        --constraint "kind=max_requests,count=$REQUESTS" \
        --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
        --data "kind=synthetic_text,prompt_tokens=256,output_tokens=32" \
        --seed kind=static,value=42 \
        --output "kind=json,path=$OUT/guidellm/benchmarks.json" \
        --disable-console-interactive ;;
    *) echo "vs-peer-harness: unknown tool '$tool' (envelope, aiperf, guidellm)" >&2 ;;
  esac
done

python3 scripts/vs-peer-harness.py "$OUT" \
  --versions "envelope=$("$ENVELOPE" --version 2>/dev/null | awk '{print $NF}' || true),aiperf=$AIPERF_VERSION,guidellm=$GUIDELLM_VERSION" \
  | tee "$OUT/summary.md"
