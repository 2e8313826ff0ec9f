"""Sustained overload with the real model: goodput through
the governor against the profile's own throughput at its safe points, per
request shape.

1. A profile: `--profile P` (for instance the quickstart's), or else
   `envelope sweep` measures one of SmolLM2-135M here (engine target, a
   short 64x32 and a long 256x32 bucket, a KV pool small enough that the KV
   cache binds) through the launch target: `envelope serve` over HTTP, as
   the governor will see it.
2. `envelope serve` runs the model with the profile's selected
   configuration (precision, KV dtype and pool, batch policy, sequences);
   `envelope govern` enforces the profile in front of it.
3. For each scenario, clients worth 4x the envelope stream completions for a
   fixed time, first straight at the server, then through the governor:
   `short` is 4 x the short bucket's safe concurrency of short requests;
   `mixed` is 2 x each bucket's safe concurrency of its own requests, half
   the envelope's worth each. A refused request (429) waits its Retry-After
   (within the run) and tries again; times are those of the attempt that
   ran.

Prints one table: requests done, 429s, preemptions, TTFT and e2e p50/p95,
the share of admitted requests within the TTFT SLO, goodput (output tok/s
over the loaded window, counting the tokens that arrived in it of whole
answers that met the TTFT and e2e SLOs) and goodput against the
profile's throughput at its safe points (for `mixed`, half of each
bucket's). The last line is the verdict (`verdict()`): every governed
run must have zero preemptions, >= 95% of admitted requests within the
TTFT SLO and goodput >= 0.9 of the profile's throughput as this client
reaches it; `--check` exits 1 otherwise.

`safe` (exactly the short bucket's safe concurrency, no overload) shows
what this client reaches at the safe point, direct and governed: the
measurement's own ceiling; with it, the governed goodput of `safe` and
`short` is also printed against that ceiling. A profile swept in process
(the quickstart's engine target) states throughput without HTTP or this
client on the same cores, which no client over HTTP reaches: the bar
scales the profile's figures by the ceiling's share of it (at most 1),
so that a healthy chain reads as a pass. `--repeat N` runs everything N
times, alternating, and reports column medians.

    scripts/govern-goodput.sh [--seconds S] [--repeat N] [--profile P] [--scenarios safe,short,mixed] [--check]
"""

import argparse
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


def sample_state(base, stop_at, out):
    """Samples the governor's /admin/state every 100 ms until `stop_at`:
    what share of the envelope is in flight, the queue, the latency guard."""
    while time.monotonic() < stop_at:
        try:
            st = json.load(urllib.request.urlopen(base + "/admin/state", timeout=2))
            out.append((st["in_flight"]["envelope_share"], st["in_flight"]["sequences"],
                        st["queue"]["requests"], st["latency_guard"]["share"]))
        except Exception:  # noqa: BLE001 - a missed sample is only a missed sample
            pass
        time.sleep(0.1)


def drive(base, shapes, seconds, slo, governed=False, stagger=0.0):
    """One client thread per (input, output) in `shapes`, back to back for `seconds`."""
    records, lock = [], threading.Lock()
    refused = [0]
    stop_at = time.monotonic() + seconds
    samples = []

    def client_loop(worker, shape):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        n_in, n_out = shape
        n = 0
        time.sleep(worker * stagger)
        while time.monotonic() < stop_at:
            prompt = [300 + (worker * 7919 + n * 104729 + i * 31) % 20000 for i in range(n_in)]
            n += 1
            t0 = time.monotonic()
            ttft, tokens, in_window, err = None, 0, 0, None
            try:
                stream = c.completions.create(
                    model="smollm2", prompt=prompt, max_tokens=n_out, temperature=0,
                    stream=True, extra_body={"ignore_eos": True})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        now = time.monotonic()
                        tokens += 1
                        in_window += now <= stop_at
                        if ttft is None:
                            ttft = now - t0
            except openai.RateLimitError as e:
                with lock:
                    refused[0] += 1
                ra = float(e.response.headers.get("retry-after", "1"))
                time.sleep(max(0.0, min(ra, stop_at - time.monotonic())))
                continue
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                err = repr(e)
            e2e = time.monotonic() - t0
            with lock:
                records.append((ttft, e2e, tokens, err, n_out, in_window))

    threads = [threading.Thread(target=client_loop, args=(w, s)) for w, s in enumerate(shapes)]
    if governed:
        threads.append(threading.Thread(target=sample_state, args=(base, stop_at, samples)))
    t_start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Goodput is counted over the loaded window only: the tokens of good
    # answers that arrived before the clients stopped. The drain after it
    # (fewer and fewer requests in flight) would understate what the
    # server sustains under load, directly or governed alike.
    window = stop_at - t_start
    ok = [r for r in records if r[3] is None]
    in_ttft = [r for r in ok if slo.get("ttft_p95_ms") is None or (r[0] or 1e9) * 1e3 <= slo["ttft_p95_ms"]]
    good = [r for r in in_ttft if r[2] == r[4]
            and (slo.get("e2e_p99_ms") is None or r[1] * 1e3 <= slo["e2e_p99_ms"])]
    return {
        "done": len(ok),
        "429s": refused[0],
        "errors": len(records) - len(ok),
        "ttft_p50_ms": pct([r[0] * 1e3 for r in ok if r[0]], 0.50),
        "ttft_p95_ms": pct([r[0] * 1e3 for r in ok if r[0]], 0.95),
        "e2e_p50_ms": pct([r[1] * 1e3 for r in ok], 0.50),
        "e2e_p95_ms": pct([r[1] * 1e3 for r in ok], 0.95),
        "in_ttft_slo": len(in_ttft) / max(1, len(ok)),
        "goodput_tok_s": sum(r[5] for r in good) / window,
        # Means over the samples of /admin/state (governed runs only).
        "in_flight_share": mean([x[0] for x in samples]),
        "in_flight_seqs": mean([x[1] for x in samples]),
        "queued": mean([x[2] for x in samples]),
        "latency_share": mean([x[3] for x in samples]),
    }


def median_of(rows):
    """Column-wise medians of result dicts (numbers only)."""
    return {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}


def mean(values):
    return sum(values) / len(values) if values else float("nan")


def at_safe_tok_s(config, row):
    """Output tok/s of the bucket at its safe concurrency: the probe there,
    else interpolated between the probes around it."""
    bucket = next(b for b in config["buckets"]
                  if b["input_tokens"] == row["input_tokens"] and b["output_tokens"] == row["output_tokens"])
    safe = row["safe_concurrency"]
    probes = sorted((p for p in bucket["probes"] if p["valid"]), key=lambda p: p["concurrency"])
    below = [p for p in probes if p["concurrency"] <= safe]
    above = [p for p in probes if p["concurrency"] > safe]
    if below and below[-1]["concurrency"] == safe:
        return below[-1]["output_tok_per_s"], f"probe at {safe}"
    if below and above:
        a, b = below[-1], above[0]
        f = (safe - a["concurrency"]) / (b["concurrency"] - a["concurrency"])
        v = a["output_tok_per_s"] + f * (b["output_tok_per_s"] - a["output_tok_per_s"])
        return v, f"interpolated between {a['concurrency']} and {b['concurrency']}"
    p = below[-1] if below else above[0]
    return p["output_tok_per_s"] * safe / p["concurrency"], f"probe at {p['concurrency']} scaled"


def sweep_profile(work, kv):
    cfg = os.path.join(work, "bench.toml")
    with open(cfg, "w") as f:
        f.write(f"""
[target]
kind = "launch"
model = "{MODEL}"
kv_cache_bytes = "{kv}"
vocab_size = 49152
command = "{BIN} serve --model {{model}} --served-model-name {{model}} --precision {{precision}} --kv-dtype {{kv_dtype}} --batch-policy {{batch_policy}} --max-num-seqs {{max_num_seqs}} --max-num-batched-tokens {{max_num_batched_tokens}} --kv-cache-bytes {{kv_cache_bytes}} --block-size {{block_size}} --host 127.0.0.1 --port {{port}}"
ready_timeout_s = 120
[matrix]
precisions = ["as-stored"]
batch_policies = ["continuous"]
max_num_seqs = 16
max_num_batched_tokens = 256
buckets = ["64x32", "256x32"]
concurrency_max = 16
[load]
rounds = 2
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
    return os.path.join(out, "profile.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="per run (default 30)")
    ap.add_argument("--profile", help="a profile to use (default: sweep one here)")
    ap.add_argument("--scenarios", default="safe,short,mixed")
    ap.add_argument("--kv", default="32MiB", help="KV pool of the sweep made here")
    ap.add_argument("--max-num-batched-tokens", default="256")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every scenario N times, alternating, and report medians (default 1)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the governed runs meet the bar")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="envelope-goodput-")
    log = open(os.path.join(work, "servers.log"), "w")
    t_sweep = time.monotonic()
    path = args.profile or sweep_profile(work, args.kv)
    t_sweep = time.monotonic() - t_sweep
    profile = json.load(open(path))
    # `envelope report --upgrade` gives the per-bucket table of an older profile.
    if not profile["limits"].get("buckets"):
        subprocess.run([BIN, "report", "--profile", path, "--out", work, "--upgrade"], check=True,
                       stdout=subprocess.DEVNULL)
        path = os.path.join(work, "profile.json")
        profile = json.load(open(path))
    config = next(c for c in profile["configs"] if c["name"] == profile["selected"])
    rows = profile["limits"]["buckets"]
    short, long_ = rows[0], rows[-1]
    slo = profile["slo"]
    mem = config["memory"]
    # A launch-target profile knows the pool in tokens, not bytes: then the
    # pool is the one the sweep gave the server.
    kv_bytes = mem["kv_capacity_tokens"] * mem["kv_bytes_per_token"] or args.kv
    shape = lambda r: (r["input_tokens"], r["output_tokens"])  # noqa: E731
    plans = {
        "short": ([shape(short)] * (4 * short["safe_concurrency"]),
                  at_safe_tok_s(config, short)),
        "mixed": ([shape(short)] * (2 * short["safe_concurrency"])
                  + [shape(long_)] * (2 * long_["safe_concurrency"]),
                  None),
    }
    s_tok, s_basis = at_safe_tok_s(config, short)
    l_tok, l_basis = at_safe_tok_s(config, long_)
    # `safe`: exactly the short bucket's safe concurrency, no overload: what
    # this client reaches at the safe point, direct and governed.
    plans["safe"] = ([shape(short)] * short["safe_concurrency"], (s_tok, s_basis))
    plans["mixed"] = (plans["mixed"][0], (0.5 * s_tok + 0.5 * l_tok, f"half of {short_label(short)} + half of {short_label(long_)}"))

    serve, upstream = start(["serve", "--model", MODEL, "--served-model-name", "smollm2",
                             "--precision", config["precision"], "--kv-dtype", config["kv_dtype"],
                             "--batch-policy", config["batch_policy"],
                             "--max-num-seqs", str(config["max_num_seqs"]),
                             "--max-num-batched-tokens", args.max_num_batched_tokens,
                             "--kv-cache-bytes", str(kv_bytes), "--port", "0"],
                            "envelope serve listening on ", log)
    runs = {}  # scenario -> [(direct, governed)] per repeat
    names = [s for s in args.scenarios.split(",") if s]
    try:
        for _ in range(args.repeat):
            for name in names:
                shapes, _ref = plans[name]
                p0 = metric(upstream, "envelope:num_preemptions_total")
                direct = drive(upstream, shapes, args.seconds, slo)
                direct["preemptions"] = metric(upstream, "envelope:num_preemptions_total") - p0
                gov, governed = start(["govern", "--profile", path, "--upstream", upstream,
                                       "--listen", "127.0.0.1:0", "--on-mismatch", "ignore"],
                                      "envelope govern listening on ", log)
                try:
                    p0 = metric(upstream, "envelope:num_preemptions_total")
                    through = drive(governed, shapes, args.seconds, slo, governed=True)
                    through["preemptions"] = metric(upstream, "envelope:num_preemptions_total") - p0
                finally:
                    gov.terminate()
                    gov.wait(10)
                runs.setdefault(name, []).append((direct, through))
    finally:
        serve.terminate()
        serve.wait(10)
    # One row per scenario and path: the median of each column over the
    # repeats (the machine's speed drifts by several percent between runs).
    results = [(name, len(plans[name][0]), plans[name][1][0], plans[name][1][1],
                median_of([d for d, _ in runs[name]]), median_of([t for _, t in runs[name]]),
                [t["goodput_tok_s"] / plans[name][1][0] for _, t in runs[name]])
               for name in names]

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {cpu}, {os.cpu_count()} cores; commit {commit}; {args.seconds:.0f} s per run"
          + (f", medians of {args.repeat} repeats" if args.repeat > 1 else "")
          + (f"; sweep {t_sweep:.0f} s" if not args.profile else ""))
    print(f"profile {path}: selected {config['name']}, KV pool {kv_bytes} bytes ({mem['kv_capacity_tokens']} tokens); "
          + ", ".join(f"{short_label(r)} safe at {r['safe_concurrency']}" for r in rows)
          + f"; SLOs: TTFT <= {slo['ttft_p95_ms']} ms, e2e <= {slo['e2e_p99_ms']} ms")
    cols = ["done", "429s", "errors", "preemptions", "ttft_p50_ms", "ttft_p95_ms",
            "e2e_p50_ms", "e2e_p95_ms", "in_ttft_slo", "goodput_tok_s",
            "in_flight_share", "in_flight_seqs", "queued", "latency_share"]
    print("| scenario | clients | path | " + " | ".join(cols) + " | goodput / profile |")
    print("|---" * (len(cols) + 4) + "|")
    for name, clients, ref, basis, direct, through, _ in results:
        for path_name, r in [("direct", direct), ("governed", through)]:
            vals = [f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
            print(f"| {name} | {clients} | {path_name} | " + " | ".join(vals)
                  + f" | {r['goodput_tok_s'] / ref:.2f} |")
    for name, clients, ref, basis, _, _, each in results:
        print(f"profile throughput for {name}: {ref:.1f} output tok/s ({basis}); governed goodput / profile per run: "
              + ", ".join(f"{x:.2f}" for x in each))
    # `safe` straight at the server is what this client reaches at the
    # safe point over HTTP on this machine: the ceiling of the short shapes.
    ceiling = next((d["goodput_tok_s"] for name, _, _, _, d, _, _ in results if name == "safe"), None)
    if ceiling:
        for name, _, _, _, _, through, _ in results:
            if name in ("safe", "short"):
                print(f"governed goodput for {name} / this client straight at the safe concurrency "
                      f"({ceiling:.1f} tok/s): {through['goodput_tok_s'] / ceiling:.2f}")
    failed, reach = verdict([(n, ref, t) for n, _, ref, _, _, t, _ in results], ceiling, s_tok)
    print("governed runs " + ("meet the bar" if not failed else f"MISS the bar: {'; '.join(failed)}")
          + " (zero preemptions, >= 95% of admitted within the TTFT SLO, goodput >= 0.9 of the "
          + ("profile's" if reach >= 1.0 else f"profile's as this client reaches it: {reach:.2f} of the profile at the safe point")
          + ")")
    if args.check and failed:
        sys.exit(1)


def verdict(results, ceiling, safe_tok_s):
    """The bar every governed run must meet, and the share of the profile's
    throughput this client reaches: `results` are (scenario, the
    profile's output tok/s for it, the governed run's figures). A run
    fails with any preemption, under 95% of admitted requests within the
    TTFT SLO, or goodput under 0.9 of the profile's throughput scaled by
    what this client reaches straight at the server at the safe point
    (`ceiling`, the `safe` direct run, over the profile's `safe_tok_s`;
    1 when that is not measured or reaches the profile): a profile swept
    in process, without HTTP or the client on the same cores, states more
    than any client over HTTP can reach, and a healthy chain must read as
    one. Returns (failed scenarios with why, the reach)."""
    reach = min(1.0, ceiling / safe_tok_s) if ceiling and safe_tok_s > 0 else 1.0
    failed = []
    for name, ref, through in results:
        why = []
        if through["preemptions"] > 0:
            why.append(f"{through['preemptions']} preemptions")
        if through["in_ttft_slo"] < 0.95:
            why.append(f"{through['in_ttft_slo']:.0%} within the TTFT SLO")
        if through["goodput_tok_s"] < 0.9 * reach * ref:
            why.append(f"goodput {through['goodput_tok_s'] / (reach * ref):.2f} of the bar's reference")
        if why:
            failed.append(f"{name} ({', '.join(why)})")
    return failed, reach


def short_label(r):
    return f"{r['input_tokens']}x{r['output_tokens']}"


if __name__ == "__main__":
    main()
