#!/usr/bin/env bash
# Sustained overload with the real model through the governor: goodput
# against the profile's throughput at its safe points, short-only and mixed
# (see scripts/govern-goodput.py). Makes what it needs: the release binary,
# the model (scripts/fetch-model.sh) and the .venv with the openai client.
#
#   scripts/govern-goodput.sh [--seconds S] [--repeat N] [--profile P] [--scenarios safe,short,mixed] [--check]
#   (default: sweeps its own profile, 30 s per run, ~5 minutes in all)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/release/envelope ] || cargo build --release --locked >&2
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash scripts/fetch-model.sh >&2
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
fi
exec .venv/bin/python scripts/govern-goodput.py "$@"
