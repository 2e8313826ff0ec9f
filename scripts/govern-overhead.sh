#!/usr/bin/env bash
# Governor overhead: open-loop load against a fast loopback upstream,
# directly and through the governor, at 500 and 2000 requests/s (or the
# rates given). Prints added latency p50/p99 (ms) and the throughput ratio
# governed/direct, with the machine. Not a timed test; results vary with
# whatever else the machine is doing (check `uptime`).
#
#   scripts/govern-overhead.sh [SECONDS_PER_RUN] [RATE...]
#   ENVELOPE_OVERHEAD_RECORD=1 adds a path through a governor with --record
#   (what recording adds to the p99); ENVELOPE_OVERHEAD_REPS sets the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-5}"
shift || true
rates=("$@")
if [ ${#rates[@]} -eq 0 ]; then rates=(500 2000); fi
cargo build --release --locked -p envelope-governor --example overhead >&2
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo n/a); commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
"${CARGO_TARGET_DIR:-target}/release/examples/overhead" "$secs" "${rates[@]}"
