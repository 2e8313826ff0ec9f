#!/usr/bin/env bash
# Sustained overload with the real model through the governor: goodput
# against the profile's throughput at its safe point (see
# scripts/govern-goodput.py). Needs the model (scripts/fetch-model.sh) and
# the .venv with the openai client (scripts/test.sh makes both).
#
#   scripts/govern-goodput.sh [SECONDS]     (default 30 per run, ~3 minutes in all)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/release/envelope ] || cargo build --release --locked >&2
[ -f models/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash scripts/fetch-model.sh >&2
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
fi
exec .venv/bin/python scripts/govern-goodput.py "$@"
