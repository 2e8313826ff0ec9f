#!/usr/bin/env bash
# Model tiers against one large tier on a mixed agent workload: cost,
# escalation rate, latency and refusals (see scripts/tiers-report.py).
# Makes what it needs: the release binary and the model.
#
#   scripts/tiers-report.sh [--calls N] [--workers W] [--seed S]
#   (default: 100 calls, 4 workers; a few minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/release/envelope ] || cargo build --release --locked >&2
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash scripts/fetch-model.sh >&2
exec python3 scripts/tiers-report.py "$@"
