"""Model tiers against one large tier, on a mixed agent workload.

Two real upstreams of the same model at two precisions stand in for a cheap
and an expensive tier: `small` is SmolLM2-135M served at q8_0, `large` the
same weights at f32 (several times the bytes read per token, so slower on
the CPU). Both are governed with the quickstart profile's limits.

The workload is seeded and the same for both runs: 80% easy calls
(feature `triage`: a sentiment label, at most 16 tokens; half of them ask
for a JSON object through `response_format`) and 20% hard calls (feature
`plan`: a short plan, 64 tokens), sent by `--workers` closed-loop clients.

- `all-large`: a tiers file with one tier, `large`: every call on it.
- `tiered`: `small` then `large`; the `plan` feature starts on `large`,
  everything else on `small`; an answer that is not the JSON it was asked
  for is retried on `large`; `small` falls back to `large` when full.

Prices are list prices of the tiers file (cost units per million tokens:
small 0.10 in / 0.40 out, large 1.00 in / 4.00 out, a 10x step as between
a small and a large hosted model); tokens are what the upstreams reported.
Prints one table: calls, refusals (429) and errors, total cost and cost per
call, escalation rate, share of calls answered by `large`, latency p50/p95
(all calls, and easy calls alone), and the share of JSON-asked calls whose
final answer parses as JSON.

    scripts/tiers-report.sh [--calls N] [--workers W] [--seed S]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

BIN = os.environ.get("ENVELOPE_BIN", "target/release/envelope")
MODEL = os.environ.get("ENVELOPE_TEST_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROFILE = "profiles/cpu-2core-smollm2-135m-q4_1-quickstart/profile.json"

PRICES = {"small": (0.10, 0.40), "large": (1.00, 4.00)}

SENTENCES = [
    "The delivery was late and the box was damaged.",
    "I love how fast the new update runs.",
    "The meeting moved to Thursday.",
    "Support answered within minutes and fixed it.",
    "The app crashes every time I open settings.",
    "Prices went up again this month.",
    "Great documentation, easy to follow.",
    "The battery lasts two days now.",
]
TASKS = [
    "migrating a web service to a new database",
    "onboarding a new engineer to the team",
    "rolling out a feature flag to all users",
    "reducing the cost of a nightly batch job",
    "preparing a quarterly incident review",
]


def start(args, prefix, log):
    proc = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "ENVELOPE_LOG": "warn"})
    for line in proc.stdout:
        if line.startswith(prefix):
            url = line.split()[-1]
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, url
    raise SystemExit(f"{args[0]} did not start; see {log.name}")


def workload(n, seed):
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        if rng.random() < 0.8:
            s = rng.choice(SENTENCES)
            as_json = rng.random() < 0.5
            if as_json:
                text = f'Label the sentiment of this review as positive, negative or neutral. Reply with JSON like {{"sentiment": "neutral"}} and nothing else.\nReview: {s}'
            else:
                text = f"Label the sentiment of this review as positive, negative or neutral. Reply with one word.\nReview: {s}"
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 0}
            if as_json:
                body["response_format"] = {"type": "json_object"}
            calls.append(("triage", as_json, body))
        else:
            t = rng.choice(TASKS)
            text = f"Write a short numbered plan of four steps for {t}."
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True}
            calls.append(("plan", False, body))
    return calls


def tiers_file(kind, small_url, large_url, path):
    def tier(name, url):
        i, o = PRICES[name]
        return (f'[tiers.{name}]\nupstreams = [{{ url = "{url}", profile = "{os.path.abspath(PROFILE)}", model = "{name}" }}]\n'
                f"price = {{ input_per_mtok = {i}, output_per_mtok = {o} }}\n")
    if kind == "all-large":
        text = 'version = "all-large"\norder = ["large"]\nprices_version = "report-1"\n' + tier("large", large_url)
    else:
        text = ('version = "tiered"\norder = ["small", "large"]\nprices_version = "report-1"\n'
                + tier("small", small_url) + tier("large", large_url)
                + '[[rules]]\nname = "planning"\ntier = "large"\nfeatures = ["plan"]\n'
                + '[fallback]\nsmall = ["large"]\n')
    with open(path, "w") as f:
        f.write(text)


def call(base, feature, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({"model": "x", **body}).encode(),
                                 headers={"content-type": "application/json", "x-envelope-feature": feature})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
            h = r.headers
            status = r.status
    except urllib.error.HTTPError as e:
        return {"status": e.code, "ms": (time.monotonic() - t0) * 1000}
    text = out["choices"][0]["message"]["content"] or ""
    return {"status": status, "ms": (time.monotonic() - t0) * 1000, "tier": h.get("x-envelope-tier"),
            "escalated": bool(h.get("x-envelope-escalated")), "cost": float(h.get("x-envelope-cost", "0")),
            "text": text}


def run(base, calls, workers):
    results = [None] * len(calls)
    nxt = iter(range(len(calls)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            feature, as_json, body = calls[i]
            r = call(base, feature, body)
            r.update(feature=feature, as_json=as_json)
            results[i] = r

    ts = [threading.Thread(target=worker) for _ in range(workers)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results, time.monotonic() - t0


def pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def parses(text):
    t = text.strip()
    if t.startswith("```"):
        t = t.strip("`").removeprefix("json").strip()
    try:
        json.loads(t)
        return True
    except ValueError:
        return False


def summary(name, results, wall):
    ok = [r for r in results if r["status"] == 200]
    easy = [r["ms"] for r in ok if r["feature"] == "triage"]
    asked = [r for r in ok if r["as_json"]]
    cost = sum(r["cost"] for r in ok)
    return {
        "run": name,
        "calls": len(results),
        "429": sum(r["status"] == 429 for r in results),
        "errors": sum(r["status"] not in (200, 429) for r in results),
        "cost": cost,
        "cost/call": cost / max(1, len(ok)),
        "escalated": sum(r["escalated"] for r in ok) / max(1, len(ok)),
        "on large": sum(r["tier"] == "large" for r in ok) / max(1, len(ok)),
        "p50 ms": pct([r["ms"] for r in ok], 0.5),
        "p95 ms": pct([r["ms"] for r in ok], 0.95),
        "easy p50 ms": pct(easy, 0.5),
        "easy p95 ms": pct(easy, 0.95),
        "JSON valid": sum(parses(r["text"]) for r in asked) / max(1, len(asked)),
        "wall s": wall,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="envelope-tiers-report-")
    log = open(os.path.join(tmp, "servers.log"), "w")
    procs = []
    try:
        common = ["--model", MODEL, "--port", "0", "--kv-cache-bytes", "64MiB", "--max-model-len", "2048"]
        p, small = start(["serve", *common, "--precision", "q8_0", "--served-model-name", "small"],
                         "envelope serve listening on", log)
        procs.append(p)
        p, large = start(["serve", *common, "--precision", "f32", "--served-model-name", "large"],
                         "envelope serve listening on", log)
        procs.append(p)
        calls = workload(a.calls, a.seed)
        rows = []
        for kind in ["all-large", "tiered"]:
            path = os.path.join(tmp, f"{kind}.toml")
            tiers_file(kind, small, large, path)
            g, base = start(["govern", "--tiers", path, "--listen", "127.0.0.1:0", "--on-mismatch", "ignore",
                             "--guard", "false"], "envelope govern listening on", log)
            try:
                results, wall = run(base, calls, a.workers)
            finally:
                g.terminate()
                g.wait()
            rows.append(summary(kind, results, wall))
        cols = list(rows[0].keys())
        print(f"# {a.calls} calls (80% easy, 20% hard, seed {a.seed}), {a.workers} workers, "
              f"{os.cpu_count()} cores; prices per Mtok small 0.10/0.40, large 1.00/4.00")
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            cells = [f"{v:.3g}" if isinstance(v, float) and k in ("cost", "cost/call") else
                     f"{v:.0%}" if k in ("escalated", "on large", "JSON valid") else
                     f"{v:.0f}" if isinstance(v, float) else str(v) for k, v in r.items()]
            print("| " + " | ".join(cells) + " |")
        a_, b_ = rows
        print(f"\ntiered / all-large: cost {b_['cost'] / a_['cost']:.2f}x, p50 {b_['p50 ms'] / a_['p50 ms']:.2f}x, "
              f"easy p50 {b_['easy p50 ms'] / a_['easy p50 ms']:.2f}x")
    finally:
        for p in procs:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
