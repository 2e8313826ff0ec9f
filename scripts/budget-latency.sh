#!/usr/bin/env bash
# Added latency of a budget decision: one `decide` over four
# buckets, in process and in a real redis-server on loopback (started
# here, on a free port, and stopped at the end), 1 and 16 callers at once.
# Prints p50/p99 (us) and decisions/s with the machine. Not a timed test.
#
#   scripts/budget-latency.sh [DECISIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-20000}"
if ! command -v redis-server >/dev/null; then
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
rpid=$!
trap 'kill $rpid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done
cargo build --release --locked -p envelope-governor --example budget_latency >&2
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(redis-server --version | cut -d' ' -f1-3); load before: $(cut -d' ' -f1-3 /proc/loadavg); commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
"${CARGO_TARGET_DIR:-target}/release/examples/budget_latency" "redis://127.0.0.1:$port" "$n"
