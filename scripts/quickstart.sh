#!/usr/bin/env bash
# Set-up and the main job on a fresh machine: fetch the model, build, sweep
# bench-configs/quickstart.toml (2 precisions x 2 batch policies x 3 buckets on
# the embedded CPU engine) into sweep-out/quickstart, serve the model and ask
# it a question over the OpenAI API, then show the chain: serve the model
# with the swept configuration, put `envelope govern` in front with the new
# profile, drive the short bucket's safe concurrency (what this client
# reaches at the safe point) and then 4x it, each straight at the server and
# through the governor, and print one table of the four.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null; then
  echo "cargo is required (https://rustup.rs)" >&2
  exit 1
fi
bash scripts/fetch-model.sh
cargo build --release --locked
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${ENVELOPE_QUICKSTART_OUT:-sweep-out/quickstart}

echo "== envelope sweep --config bench-configs/quickstart.toml --out $OUT"
target/release/envelope sweep --config bench-configs/quickstart.toml --out "$OUT"

echo "== envelope serve (loopback) and one chat request"
log=$(mktemp)
target/release/envelope serve --model "$MODEL" --port 0 --kv-cache-bytes 256MiB --served-model-name smollm2 >"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 120); do
  url=$(sed -n 's/^envelope serve listening on //p' "$log")
  [ -n "$url" ] && break
  sleep 0.5
done
[ -n "$url" ] || { echo "server did not start" >&2; exit 1; }
curl -sS "$url/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"smollm2","messages":[{"role":"user","content":"What is 2+2?"}],"max_tokens":40,"temperature":0}'
echo
target/release/envelope probe --server "$url"

echo "== the chain: the safe concurrency, then 4x it, direct vs through envelope govern"
kill $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
bash scripts/govern-goodput.sh --profile "$OUT/profile.json" --scenarios safe,short \
  --seconds "${ENVELOPE_QUICKSTART_BURST_S:-20}"
