"""Sustained overload with the real model (issue #5): goodput through the
governor against the profile's own throughput at its safe point.

1. `envelope sweep` measures a profile of SmolLM2-135M (engine target, one
   64x32 bucket, a KV pool small enough that the KV cache binds).
2. `envelope serve` runs the same model and pool; `envelope govern` enforces
   the profile in front of it.
3. 4x the safe concurrency of clients (the official `openai` client, which
   honours Retry-After) stream completions for a fixed time, first straight
   at the server, then through the governor.

Prints a table: requests done, 429s seen, preemptions, TTFT/e2e p50/p99 and
goodput (output tokens/s of requests that met the profile's TTFT and e2e
SLOs) against the profile's output tokens/s at the safe concurrency.

    scripts/govern-goodput.sh [SECONDS]        (default 30)
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai

BIN = os.environ.get("ENVELOPE_BIN", "target/release/envelope")
MODEL = os.environ.get("ENVELOPE_TEST_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
KV = os.environ.get("ENVELOPE_GOODPUT_KV", "16MiB")
SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
IN_TOKENS, OUT_TOKENS = 64, 32


def start(args, prefix, log):
    proc = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "ENVELOPE_LOG": "warn"})
    for line in proc.stdout:
        if line.startswith(prefix):
            url = line.split()[-1]
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, url
    raise SystemExit(f"{args[0]} did not start; see {log.name}")


def metric(base, name):
    text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return float(parts[1])
    return 0.0


def pct(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def drive(base, clients, seconds, slo):
    """`clients` threads streaming completions back to back for `seconds`."""
    records, lock = [], threading.Lock()
    refused = [0]
    stop_at = time.monotonic() + seconds

    def client_loop(worker):
        # max_retries: the client sleeps Retry-After between attempts.
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=50, timeout=120)
        n = 0
        while time.monotonic() < stop_at:
            prompt = [300 + (worker * 7919 + n * 104729 + i * 31) % 20000 for i in range(IN_TOKENS)]
            n += 1
            t0 = time.monotonic()
            ttft, tokens, err = None, 0, None
            try:
                raw = c.completions.with_raw_response.create(
                    model="smollm2", prompt=prompt, max_tokens=OUT_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True})
                with lock:
                    refused[0] += int(raw.retries_taken)
                for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].text:
                        tokens += 1
                        if ttft is None:
                            ttft = time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                err = repr(e)
            e2e = time.monotonic() - t0
            with lock:
                records.append((ttft, e2e, tokens, err, time.monotonic()))

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(clients)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t_start
    ok = [r for r in records if r[3] is None]
    good = [r for r in ok
            if (slo.get("ttft_p95_ms") is None or (r[0] or 1e9) * 1e3 <= slo["ttft_p95_ms"])
            and (slo.get("e2e_p99_ms") is None or r[1] * 1e3 <= slo["e2e_p99_ms"])]
    return {
        "done": len(ok),
        "errors": len(records) - len(ok),
        "retries_429": refused[0],
        "ttft_p50_ms": pct([r[0] * 1e3 for r in ok if r[0]], 0.50),
        "ttft_p99_ms": pct([r[0] * 1e3 for r in ok if r[0]], 0.99),
        "e2e_p50_ms": pct([r[1] * 1e3 for r in ok], 0.50),
        "e2e_p99_ms": pct([r[1] * 1e3 for r in ok], 0.99),
        "goodput_tok_s": sum(r[2] for r in good) / wall,
        "good_fraction": len(good) / max(1, len(ok)),
        "wall_s": wall,
    }


def main():
    work = tempfile.mkdtemp(prefix="envelope-goodput-")
    log = open(os.path.join(work, "servers.log"), "w")
    cfg = os.path.join(work, "bench.toml")
    with open(cfg, "w") as f:
        f.write(f"""
[target]
kind = "engine"
model = "{MODEL}"
kv_cache_bytes = "{KV}"
[matrix]
precisions = ["as-stored"]
batch_policies = ["continuous"]
max_num_seqs = 16
max_num_batched_tokens = 256
buckets = ["{IN_TOKENS}x{OUT_TOKENS}"]
concurrency_max = 16
[load]
rounds = 3
min_requests = 6
[slo]
ttft_p95_ms = 4000
itl_p95_ms = 400
e2e_p99_ms = 15000
headroom = 0.1
""")
    out = os.path.join(work, "sweep")
    subprocess.run([BIN, "sweep", "--config", cfg, "--out", out], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "ENVELOPE_LOG": "warn"})
    profile = json.load(open(os.path.join(out, "profile.json")))
    bucket = profile["configs"][0]["buckets"][0]
    safe = bucket["safe_concurrency"]
    at_safe = [p for p in bucket["probes"] if p["concurrency"] == safe and not p["breaches"]]
    if at_safe:
        profile_tok_s, basis = at_safe[0]["output_tok_per_s"], f"probe at concurrency {safe}"
    else:
        f = bucket["at_feasible"]
        profile_tok_s = f["output_tok_per_s"] * safe / f["concurrency"]
        basis = f"feasible probe ({f['concurrency']}) scaled by {safe}/{f['concurrency']}"
    slo = profile["slo"]
    clients = 4 * safe

    serve, upstream = start(["serve", "--model", MODEL, "--served-model-name", "smollm2",
                             "--kv-cache-bytes", KV, "--max-num-seqs", "16",
                             "--max-num-batched-tokens", "256", "--port", "0"],
                            "envelope serve listening on ", log)
    try:
        p0 = metric(upstream, "envelope:num_preemptions_total")
        direct = drive(upstream, clients, SECONDS, slo)
        direct["preemptions"] = metric(upstream, "envelope:num_preemptions_total") - p0
        gov, governed = start(["govern", "--profile", os.path.join(out, "profile.json"),
                               "--upstream", upstream, "--listen", "127.0.0.1:0",
                               "--on-mismatch", "ignore"],
                              "envelope govern listening on ", log)
        try:
            p0 = metric(upstream, "envelope:num_preemptions_total")
            through = drive(governed, clients, SECONDS, slo)
            through["preemptions"] = metric(upstream, "envelope:num_preemptions_total") - p0
        finally:
            gov.terminate()
            gov.wait(10)
    finally:
        serve.terminate()
        serve.wait(10)

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {cpu}, {os.cpu_count()} cores; commit {commit}; {SECONDS:.0f} s per run")
    print(f"model {MODEL}, KV pool {KV} ({profile['configs'][0]['memory']['kv_capacity_tokens']} tokens), "
          f"bucket {IN_TOKENS}x{OUT_TOKENS}; profile: feasible {bucket['feasible_concurrency']}, "
          f"safe {safe} ({bucket['binding_constraint']}), limits {profile['limits']}")
    print(f"profile output tok/s at the safe point: {profile_tok_s:.1f} ({basis}); "
          f"SLOs: TTFT <= {slo['ttft_p95_ms']} ms, e2e <= {slo['e2e_p99_ms']} ms; {clients} clients")
    cols = ["done", "retries_429", "errors", "preemptions", "ttft_p50_ms", "ttft_p99_ms",
            "e2e_p50_ms", "e2e_p99_ms", "good_fraction", "goodput_tok_s"]
    print("| path | " + " | ".join(cols) + " | goodput / profile |")
    print("|---" * (len(cols) + 2) + "|")
    for name, r in [("direct", direct), ("governed", through)]:
        vals = [f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(f"| {name} | " + " | ".join(vals) + f" | {r['goodput_tok_s'] / profile_tok_s:.2f} |")


if __name__ == "__main__":
    main()
