#!/usr/bin/env bash
# The gate telling drift from a regression, on this machine: the
# quickstart configuration (bench-configs/quickstart.toml) cut to one
# configuration (as-stored, continuous) and one bucket (64x32), swept with
# REPEATS repeats (default 12, docs/gate.md) three times:
#   baseline    - 2 compute threads
#   same        - 2 compute threads again (drift only)
#   regression  - 1 compute thread (a real slowdown)
# then `envelope gate` of `same` and of `regression` against `baseline`
# under `decode_tok_s >= 0.95 x baseline` and `safe_concurrency >= 1.0 x
# baseline`. The first should pass (or say it cannot tell), the second
# fail. ENVELOPE_BIN names the binary (default: the release build, built
# first). Output: $OUT (default profiles/gate-noise-example-cpu-2core-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."

REPEATS=${REPEATS:-12}
OUT=${ENVELOPE_GATE_NOISE_OUT:-profiles/gate-noise-example-cpu-2core-smollm2}
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash scripts/fetch-model.sh
if [ -n "${ENVELOPE_BIN:-}" ]; then
  BIN=$ENVELOPE_BIN
else
  cargo build --release --locked
  BIN=target/release/envelope
fi
mkdir -p "$OUT"
sed -e 's/^precisions = .*/precisions = ["as-stored"]/' \
  -e 's/^batch_policies = .*/batch_policies = ["continuous"]/' \
  -e 's/^buckets = .*/buckets = ["64x32"]/' \
  bench-configs/quickstart.toml >"$OUT/bench-config.toml"
cat >"$OUT/rules.toml" <<'RULES'
rules = ["decode_tok_s >= 0.95 x baseline", "safe_concurrency >= 1.0 x baseline"]
confidence = 0.9
noise_floor = 0.1
RULES

start=$SECONDS
for run in baseline:2 same:2 regression:1; do
  name=${run%%:*}
  threads=${run##*:}
  echo "== envelope sweep --config $OUT/bench-config.toml --repeats $REPEATS --threads $threads --out $OUT/$name"
  "$BIN" sweep --config "$OUT/bench-config.toml" --repeats "$REPEATS" --threads "$threads" --out "$OUT/$name"
done
took=$((SECONDS - start))

codes=""
for cand in same regression; do
  echo "== envelope gate --baseline $OUT/baseline/profile.json --candidate $OUT/$cand/profile.json --rules $OUT/rules.toml"
  set +e
  "$BIN" gate --baseline "$OUT/baseline/profile.json" --candidate "$OUT/$cand/profile.json" \
    --rules "$OUT/rules.toml" --out "$OUT/gate-$cand-vs-baseline"
  code=$?
  set -e
  echo "exit code $code" | tee "$OUT/gate-$cand-vs-baseline/exit-code.txt"
  codes="$codes $cand:$code"
done

{
  echo "# Run"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- src crates Cargo.lock || echo ' (working tree had uncommitted changes)')"
  echo "- binary: $BIN"
  echo "- cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "- memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  echo "- command: REPEATS=$REPEATS scripts/gate-noise-example.sh"
  echo "- three sweeps of $REPEATS repeats: ${took} s"
  echo "- gate exit codes:$codes"
} >"$OUT/RUN.md"
echo "gate exit codes:$codes"
