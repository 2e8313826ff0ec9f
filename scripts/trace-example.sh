#!/usr/bin/env bash
# The loop on this machine (docs/plan.md#the-loop): record real traffic with
# the governor, replay the record on a node with `envelope sweep`'s
# [load.trace], and plan from it.
#   1. `envelope serve` (SmolLM2-135M Q4_1 as q8_0, the quickstart profile's
#      selected configuration) on a loopback port;
#   2. `envelope govern --record` in front of it, enforcing the quickstart
#      profile, two tenants by API key;
#   3. scripts/trace-traffic.py through the governor for TRAFFIC_S seconds
#      (default 120): agent runs of three calls and single chats;
#   4. SIGTERM to the governor (it drains, then flushes the record);
#   5. `envelope sweep` of the server: one bucket, then the record replayed
#      at time-scale factors 0.5, 1, 1.5 ... 8 (bench-config.toml in $OUT);
#   6. `envelope plan --workload-from` the record on the new profile.
# ENVELOPE_BIN names the binary (default: the release build, built first).
# Output: $OUT (default profiles/cpu-2core-smollm2-135m-q4_1-trace-replay):
# the profile and its raw CSVs, the recorded trace, the derived workload and
# plan, and the logs.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${ENVELOPE_TRACE_OUT:-profiles/cpu-2core-smollm2-135m-q4_1-trace-replay}
TRAFFIC_S=${TRAFFIC_S:-120}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || bash scripts/fetch-model.sh
if [ -n "${ENVELOPE_BIN:-}" ]; then
  BIN=$ENVELOPE_BIN
else
  cargo build --release --locked
  BIN=target/release/envelope
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_ok() {
  for _ in $(seq 1 300); do
    curl -fsS "$1" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "$1 did not answer" >&2
  return 1
}
rm -rf "$OUT"
mkdir -p "$OUT"
SERVE_PORT=$(free_port)
GOV_PORT=$(free_port)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

"$BIN" serve --model "$MODEL" --served-model-name smollm2 --precision q8_0 \
  --kv-cache-bytes 64MiB --max-num-seqs 16 --max-num-batched-tokens 256 \
  --host 127.0.0.1 --port "$SERVE_PORT" >"$OUT/serve.log" 2>&1 &
pids+=($!)
wait_ok "http://127.0.0.1:$SERVE_PORT/health"

cat >"$OUT/tenants.toml" <<'TENANTS'
[tenants.team-agents]
guaranteed = 0.5
api_keys = ["sk-agents"]
[tenants.team-chat]
guaranteed = 0.3
api_keys = ["sk-chat"]
TENANTS
ENVELOPE_RECORD_SALT=trace-example-salt "$BIN" govern \
  --profile profiles/cpu-2core-smollm2-135m-q4_1-quickstart/profile.json \
  --upstream "http://127.0.0.1:$SERVE_PORT" --listen "127.0.0.1:$GOV_PORT" \
  --tenants "$OUT/tenants.toml" --record "$OUT/recorded-trace.jsonl" >"$OUT/govern.log" 2>&1 &
GOV=$!
pids+=($GOV)
wait_ok "http://127.0.0.1:$GOV_PORT/metrics"

start=$SECONDS
echo "recording ${TRAFFIC_S} s of traffic through the governor ..."
python3 scripts/trace-traffic.py "http://127.0.0.1:$GOV_PORT" "$TRAFFIC_S" | tee "$OUT/traffic.json"
curl -fsS "http://127.0.0.1:$GOV_PORT/metrics" | grep -E '^envelope_governor_records_(written|dropped)_total' | tee "$OUT/record-counters.txt"
kill -TERM "$GOV"
wait "$GOV" || true
echo "recorded $(wc -l <"$OUT/recorded-trace.jsonl") requests in $((SECONDS - start)) s"

cat >"$OUT/bench-config.toml" <<CONFIG
# scripts/trace-example.sh: the server the trace was recorded on, one
# bucket, then the recorded trace replayed at time-scale factors.
[target]
kind = "http"
model = "smollm2"
base_url = "http://127.0.0.1:$SERVE_PORT"
vocab_size = 49152
[matrix]
buckets = ["128x32"]
concurrency_max = 16
[load]
rounds = 1
min_requests = 4
collapse_probes = 2
[load.trace]
path = "$OUT/recorded-trace.jsonl"
scale_min = 0.5
scale_step = 0.5
scale_max = 8
window_s = 30
[slo]
ttft_p95_ms = 4000
itl_p95_ms = 400
max_error_rate = 0.0
headroom = 0.1
CONFIG
start=$SECONDS
"$BIN" sweep --config "$OUT/bench-config.toml" --out "$OUT" 2>&1 | tee "$OUT/sweep.log"
echo "sweep: $((SECONDS - start)) s"
"$BIN" plan --workload-from "$OUT/recorded-trace.jsonl" --profile "$OUT/profile.json" >"$OUT/plan.txt" 2>&1 || true
sed -n '/^# derived/,/^envelope plan:/p' "$OUT/plan.txt" | sed '$d' >"$OUT/derived-workload.toml"
echo "wrote $OUT"
