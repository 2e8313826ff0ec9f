#!/usr/bin/env python3
"""Traffic for recording a trace: agent runs and chats through a governor.

    trace-traffic.py BASE_URL SECONDS

Two tenants (API keys from scripts/trace-example.sh's tenants file):
- team-agents: agent runs, Poisson, one every 6 s on average; a run is three
  chat calls in a row under one `x-envelope-conversation`, over a shared
  system prompt, each call's prompt the previous one, its answer and a tool
  result (feature `agent`, at most 24 output tokens);
- team-chat: single chat questions, Poisson, one every 2 s on average, of
  20 to 60 words (feature `chat`, 8 to 32 output tokens).
Every call is sent at its arrival on a thread of its own (open loop). Prints
what was sent and answered. Loopback only: it refuses any other address.
"""
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

SYSTEM = (
    "You are the support agent of a small bookshop. Answer in one short "
    "sentence. Use the tools when an order number is given: lookup_order, "
    "track_parcel, refund. Never promise dates you cannot see in a tool result. "
    "Keep a friendly tone and do not repeat the question."
)
WORDS = (
    "book order parcel refund author novel poetry shelf delivery address "
    "invoice price discount edition paperback hardcover gift voucher week "
    "store open close return damaged missing late early review series"
).split()

stats = {"sent": 0, "ok": 0, "refused": 0, "failed": 0}
lock = threading.Lock()


def post(base, key, headers, body):
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {key}", **headers},
    )
    with lock:
        stats["sent"] += 1
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            v = json.load(r)
        with lock:
            stats["ok"] += 1
        return v["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        with lock:
            stats["refused" if e.code == 429 else "failed"] += 1
    except Exception:  # noqa: BLE001 - counted, the traffic goes on
        with lock:
            stats["failed"] += 1
    return None


def agent_run(base, n, rng):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Where is my order {rng.randint(1000, 9999)}?"},
    ]
    headers = {"x-envelope-conversation": f"run-{n}", "x-envelope-feature": "agent"}
    for call in range(3):
        answer = post(base, "sk-agents", headers, {"model": "smollm2", "max_tokens": 24, "messages": messages})
        if answer is None:
            return
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": f"Tool result {call}: status shipped, depot {rng.choice(WORDS)}."})


def chat(base, rng):
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
    post(
        base,
        "sk-chat",
        {"x-envelope-feature": "chat"},
        {"model": "smollm2", "max_tokens": rng.randint(8, 32), "messages": [{"role": "user", "content": words}]},
    )


def main():
    base, seconds = sys.argv[1].rstrip("/"), float(sys.argv[2])
    host = urllib.parse.urlparse(base).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"{host}: traffic is only sent to loopback addresses")
    rng = random.Random(42)
    # Arrivals of both streams, merged.
    arrivals = []
    for kind, gap in (("agent", 6.0), ("chat", 2.0)):
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / gap)
            if t >= seconds:
                break
            arrivals.append((t, kind))
    arrivals.sort()
    threads, start = [], time.monotonic()
    for n, (t, kind) in enumerate(arrivals):
        time.sleep(max(0.0, start + t - time.monotonic()))
        seed = rng.random()
        target = (lambda n=n, s=seed: agent_run(base, n, random.Random(s))) if kind == "agent" else (
            lambda s=seed: chat(base, random.Random(s))
        )
        th = threading.Thread(target=target)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
