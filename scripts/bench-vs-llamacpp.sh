#!/usr/bin/env bash
# The embedded CPU engine against llama.cpp on the same machine, in one run:
# installs the peer (llama-cpp-python, built from source for this CPU with
# GGML_NATIVE=ON) into .venv-llamacpp, then measures both engines ROUNDS
# times, alternating, on SmolLM2-135M-Instruct Q4_1 with THREADS threads,
# and prints the best of the rounds for each figure with the ratio.
#
#   scripts/bench-vs-llamacpp.sh [ROUNDS]   (default 3)
#
# ENVELOPE_BIN (default target/release/envelope, built when missing),
# THREADS (default: all logical cores) and KV (envelope's KV dtype,
# default f16: llama.cpp's default KV cache type) override. Decode figures
# on both sides come from the median step. Figures:
#   prefill 512       one 512-token prompt, one forward pass
#   decode short      one sequence after a 32-token prompt
#   decode after 512  one sequence after the 512-token prompt
#   decode 16 seqs    envelope only: 16 sequences in one batch, aggregate
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
threads=${THREADS:-$(nproc)}
kv=${KV:-f16}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
BIN=${ENVELOPE_BIN:-target/release/envelope}
bash scripts/fetch-model.sh >/dev/null
if [ ! -x "$BIN" ]; then
  cargo build --release --locked
fi
VENV=.venv-llamacpp
if ! "$VENV/bin/python" -c 'import llama_cpp' 2>/dev/null; then
  echo "installing llama-cpp-python 0.3.36 into $VENV (builds llama.cpp: several minutes)" >&2
  python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/pip" install --quiet --disable-pip-version-check \
    --no-binary llama-cpp-python llama-cpp-python==0.3.36
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  RAYON_NUM_THREADS=$threads "$BIN" bench-engine --model "$MODEL" --kv-cache-bytes 512MiB \
    --kv-dtype "$kv" --concurrency 1,16 --json >"$out/envelope-$r.json"
  "$VENV/bin/python" scripts/bench_llamacpp.py "$MODEL" "$threads" >"$out/llamacpp-$r.json"
done
python3 - "$out" "$rounds" "$threads" <<'PY'
import glob, json, platform, sys
out, rounds, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
env = [json.load(open(f)) for f in sorted(glob.glob(out + "/envelope-*.json"))]
lcp = [json.loads(open(f).read().strip().splitlines()[-1]) for f in sorted(glob.glob(out + "/llamacpp-*.json"))]
def agg(r, c):
    return next(a["decode_tok_per_s"] for a in r["aggregate"] if a["concurrency"] == c)
rows = [
    ("prefill 512", [r["prefill_tok_per_s"] for r in env], [r["prefill_tok_per_s"] for r in lcp]),
    ("decode short (32-token prompt)", [agg(r, 1) for r in env], [r["decode_short_tok_per_s"] for r in lcp]),
    ("decode after 512", [r["single_decode_tok_per_s"] for r in env], [r["decode_after_prompt_tok_per_s"] for r in lcp]),
]
e0 = env[0]
print(f"machine: {e0['cpu']}, {threads} threads; {platform.platform()}")
print(f"model:   {e0['model']} ({e0['precision']}); KV: envelope {e0['kv_dtype']}, llama.cpp f16")
print(f"peer:    llama.cpp via llama-cpp-python {lcp[0]['version']} (GGML_NATIVE=ON)")
print(f"         {lcp[0]['system_info'].strip()}")
print(f"best of {rounds} alternating rounds, tok/s\n")
print(f"| figure | envelope | llama.cpp | ratio |")
print(f"|---|---|---|---|")
for name, e, l in rows:
    print(f"| {name} | {max(e):.1f} | {max(l):.1f} | {max(e) / max(l):.2f}x |")
# Batching pays: 16 sequences against one, within each envelope run (the
# two figures come from the same process minutes apart, not from rounds
# that a neighbour's load may have hit differently).
# The median run: one disturbed short-decode figure must not make the ratio.
per_run = [agg(r, 16) / agg(r, 1) for r in env]
many = max(agg(r, 16) for r in env)
mid = sorted(per_run)[len(per_run) // 2]
print(f"| decode 16 seqs, aggregate | {many:.1f} | - | {mid:.2f}x envelope's short decode in the same run (median; runs: {', '.join(f'{x:.2f}' for x in per_run)}) |")
print("\nevery round (envelope / llama.cpp):")
for name, e, l in rows:
    print(f"  {name:32} " + "  ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(e, l)))
PY
