#!/usr/bin/env bash
# Overload demonstration, as a table: `envelope serve` with a
# small KV pool (dummy:tiny, 512 KiB = 1024 tokens), a profile whose safe
# concurrency is 4 (48 + 192 tokens per request), and 4x that many
# concurrent completions, first directly, then through `envelope govern`.
# Directly the server preempts; through the governor it does not, and the
# excess gets 429 with Retry-After. tests/it/govern.rs asserts the same.
#
#   scripts/govern-overload.sh [CONCURRENCY]     (default 16)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-16}"
bin="${ENVELOPE_BIN:-target/release/envelope}"
[ -x "$bin" ] || cargo build --release --locked >&2
work="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

wait_url() { # file prefix -> url
  for _ in $(seq 600); do
    if grep -q "$2" "$1" 2>/dev/null; then grep "$2" "$1" | head -1 | awk '{print $NF}'; return; fi
    sleep 0.1
  done
  echo "timed out waiting for $2" >&2; exit 1
}

ENVELOPE_LOG=warn "$bin" serve --model dummy:tiny --kv-cache-bytes 512KiB --max-num-seqs 64 --port 0 >"$work/serve.out" &
pids+=($!)
upstream="$(wait_url "$work/serve.out" "envelope serve listening on ")"

cat >"$work/profile.json" <<EOF
{"schema": "envelope.profile/v1", "created_unix_ms": 1,
 "fingerprint": {"model": {"kind": "dummy", "preset": "tiny", "seed": 0}, "node": {"gpus": []}},
 "slo": {"ttft_p95_ms": null, "itl_p95_ms": null, "e2e_p99_ms": null},
 "configs": [], "selected": "dummy-tiny-512KiB", "probes_total": 0,
 "limits": {"max_context_tokens": 1024, "max_output_tokens": 256,
            "max_concurrent_seqs": 4, "max_kv_tokens_in_flight": 960}}
EOF

prompt="$(printf 'hello %.0s' $(seq 8))"
body="{\"model\": \"dummy:tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 192, \"temperature\": 0, \"ignore_eos\": true}"
preemptions() { curl -s "$upstream/metrics" | awk '$1 == "envelope:num_preemptions_total" {print $2}'; }

run() { # base -> "ok refused preemptions p50_s max_s"
  local before after
  before="$(preemptions)"
  seq "$n" | xargs -P "$n" -I{} curl -s -o /dev/null -D "$work/h{}" -w '%{http_code} %{time_total}\n' \
    -H 'content-type: application/json' -d "$body" "$1/v1/completions" >"$work/results"
  after="$(preemptions)"
  local ok refused ra
  ok="$(awk '$1 == 200' "$work/results" | wc -l)"
  refused="$(awk '$1 == 429' "$work/results" | wc -l)"
  ra="$(cat "$work"/h* 2>/dev/null | tr -d '\r' | awk -F': ' 'tolower($1) == "retry-after" {print $2}' | sort -n | uniq | paste -sd, -)"
  rm -f "$work"/h*
  local p50 max
  p50="$(awk '$1 == 200 {print $2}' "$work/results" | sort -n | awk '{a[NR]=$1} END {print (NR ? a[int((NR+1)/2)] : "-")}')"
  max="$(awk '$1 == 200 {print $2}' "$work/results" | sort -n | tail -1)"
  echo "$ok $refused $(awk -v a="$before" -v b="$after" 'BEGIN {print b - a}') ${p50:--} ${max:--} ${ra:--}"
}

direct="$(run "$upstream")"
# The governor starts after the direct run, so its live guard does not see
# those preemptions (it would tighten the caps: SMALL_CONTEXT).
ENVELOPE_LOG=warn "$bin" govern --profile "$work/profile.json" --upstream "$upstream" \
  --listen 127.0.0.1:0 --max-queue-len 4 --on-mismatch ignore >"$work/govern.out" &
pids+=($!)
governed="$(wait_url "$work/govern.out" "envelope govern listening on ")"
gov="$(run "$governed")"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
echo "dummy:tiny, KV pool 1024 tokens; $n concurrent completions of 48 + 192 tokens (profile: 4 sequences, 960 KV tokens)"
printf '%-9s | %6s | %6s | %11s | %11s | %11s | %s\n' path "200" "429" preemptions "p50 e2e s" "max e2e s" "Retry-After s"
for row in "direct $direct" "governed $gov"; do
  set -- $row
  printf '%-9s | %6s | %6s | %11s | %11s | %11s | %s\n' "$1" "$2" "$3" "$4" "$5" "$6" "$7"
done
