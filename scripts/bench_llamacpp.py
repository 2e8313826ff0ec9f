"""llama.cpp's figures for scripts/bench-vs-llamacpp.sh, measured the way
`envelope bench-engine` measures its own: prefill of one 512-token prompt
(one llama_decode call), single-sequence decode after that prompt, and
single-sequence decode after a 32-token prompt, each token its own
llama_decode call, from the median step time as on envelope's side. Synthetic token ids, greedy-free (no sampling: only
the forward pass is timed, as on envelope's side). Prints one JSON line.

    python bench_llamacpp.py MODEL THREADS [PROMPT] [DECODE] [SHORT]
"""
import json
import random
import statistics
import sys
import time

import llama_cpp
from llama_cpp import Llama


def main():
    model, threads = sys.argv[1], int(sys.argv[2])
    prompt = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    decode = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    short = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    llm = Llama(
        model_path=model,
        n_ctx=prompt + decode + 64,
        n_batch=prompt,
        n_ubatch=prompt,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    vocab = llm.n_vocab()
    rng = random.Random(1)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]

    def run(n_prompt):
        llm.reset()
        llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        llm.eval(ids(n_prompt))
        pre = time.perf_counter() - t
        steps = []
        for tok in ids(decode):
            t = time.perf_counter()
            llm.eval([tok])
            steps.append(time.perf_counter() - t)
        return n_prompt / pre, 1.0 / statistics.median(steps)

    run(64)  # warm-up: pages in the weights
    prefill, after = run(prompt)
    _, short_decode = run(short)
    print(
        json.dumps(
            {
                "engine": "llama.cpp",
                "version": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(),
                "threads": threads,
                "prompt_tokens": prompt,
                "prefill_tok_per_s": prefill,
                "decode_after_prompt_tok_per_s": after,
                "decode_short_tok_per_s": short_decode,
            }
        )
    )


if __name__ == "__main__":
    main()
