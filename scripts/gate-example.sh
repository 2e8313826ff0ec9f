#!/usr/bin/env bash
# The precision gate on this machine: SmolLM2-135M on the
# embedded CPU engine at f16 (baseline), q8_0 and q4_0 (candidates).
# For each precision: a one-bucket sweep (bench-configs/gates/cpu-smollm2.toml
# with that precision), then `envelope quality` against f32 written into the
# profile; then `envelope gate` of each candidate against f16 under
# bench-configs/gates/precision.toml. Takes about 8-10 minutes on 2 cores.
# Output: $OUT (default profiles/gate-example-cpu-2core-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${ENVELOPE_GATE_EXAMPLE_OUT:-profiles/gate-example-cpu-2core-smollm2}
RULES=bench-configs/gates/precision.toml
[ -f "$MODEL" ] || bash scripts/fetch-model.sh
cargo build --release --locked
BIN=target/release/envelope
mkdir -p "$OUT"

for p in f16 q8_0 q4_0; do
  dir="$OUT/$p"
  mkdir -p "$dir"
  sed "s/^precisions = .*/precisions = [\"$p\"]/" bench-configs/gates/cpu-smollm2.toml >"$dir/bench-config.toml"
  echo "== envelope sweep --config $dir/bench-config.toml --out $dir"
  "$BIN" sweep --config "$dir/bench-config.toml" --out "$dir"
  echo "== envelope quality --model $MODEL --precision $p --reference f32 --profile $dir/profile.json"
  "$BIN" quality --model "$MODEL" --precision "$p" --reference f32 --profile "$dir/profile.json" | tee "$dir/quality.txt"
  # The reports again, now that the profile has its quality section.
  "$BIN" report --profile "$dir/profile.json" >/dev/null
done

codes=""
for p in q8_0 q4_0; do
  echo "== envelope gate --baseline $OUT/f16/profile.json --candidate $OUT/$p/profile.json --rules $RULES"
  set +e
  "$BIN" gate --baseline "$OUT/f16/profile.json" --candidate "$OUT/$p/profile.json" \
    --rules "$RULES" --out "$OUT/gate-$p-vs-f16"
  code=$?
  set -e
  echo "exit code $code" | tee "$OUT/gate-$p-vs-f16/exit-code.txt"
  codes="$codes $p:$code"
done

{
  echo "# Run"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- src crates Cargo.lock || echo ' (working tree had uncommitted changes)')"
  echo "- cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "- memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "- command: scripts/gate-example.sh"
  echo "- gate exit codes:$codes"
} >"$OUT/RUN.md"
echo "gate exit codes:$codes"
