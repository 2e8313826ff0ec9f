"""The official `openai` Python client through `envelope govern` in front of
`envelope serve`: refusals arrive as the client's typed errors,
`RateLimitError` carries Retry-After and the client honours it, and a
request that can never fit is a `BadRequestError` with code
`context_length_exceeded` (never retried).

Run by scripts/test.sh; ENVELOPE_BIN and ENVELOPE_TEST_MODEL point at the
binary and the SmolLM2 GGUF.
"""

import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.request

import openai
import pytest

try:  # the openai client in .venv is built on httpx2; upstream openai on httpx
    import httpx2 as httpx
except ImportError:
    import httpx

BIN = os.environ.get("ENVELOPE_BIN", "target/release/envelope")
MODEL = os.environ.get("ENVELOPE_TEST_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")


def start(args, prefix):
    proc = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "ENVELOPE_LOG": "warn"})
    url = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith(prefix):
                url.append(line.split()[-1])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(120), f"{args[0]} did not start"
    return proc, url[0]


@pytest.fixture(scope="module")
def governed():
    server, upstream = start(["serve", "--model", MODEL, "--port", "0", "--kv-cache-bytes", "64MiB",
                              "--served-model-name", "smollm2"], "envelope serve listening on ")
    profile = {
        "schema": "envelope.profile/v1", "created_unix_ms": 1,
        "fingerprint": {"model": {"kind": "served", "id": "smollm2"}, "node": {"gpus": []}},
        "slo": {"ttft_p95_ms": None, "itl_p95_ms": None, "e2e_p99_ms": None},
        "configs": [], "selected": "python-test", "probes_total": 0,
        "limits": {"max_context_tokens": 256, "max_output_tokens": 200,
                   "max_concurrent_seqs": 1, "max_kv_tokens_in_flight": 400},
    }
    d = tempfile.mkdtemp()
    path = os.path.join(d, "profile.json")
    with open(path, "w") as f:
        json.dump(profile, f)
    # One sequence at a time and no waiting room: a second request is refused.
    gov, url = start(["govern", "--profile", path, "--upstream", upstream, "--listen", "127.0.0.1:0",
                      "--max-queue-len", "0", "--on-mismatch", "ignore"],
                     "envelope govern listening on ")
    yield url
    gov.terminate()
    server.terminate()
    gov.wait(30)
    server.wait(30)


def hold_the_only_slot(url):
    """Runs a ~200-token completion in a thread; returns once it is in flight."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    t = threading.Thread(target=lambda: client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True}))
    t.start()
    for _ in range(200):
        state = json.load(urllib.request.urlopen(url + "/admin/state"))
        if state["in_flight"]["requests"] == 1:
            return t
        time.sleep(0.01)
    raise AssertionError("the first request never got in flight")


def test_context_length_exceeded_is_bad_request(governed):
    client = openai.OpenAI(base_url=governed + "/v1", api_key="unused", max_retries=2, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "tell me more " * 100}], max_tokens=50)
    assert e.value.code == "context_length_exceeded"
    assert e.value.param == "messages"
    assert e.value.response.headers["x-should-retry"] == "false"


def test_rate_limit_error_with_retry_after(governed):
    t = hold_the_only_slot(governed)
    client = openai.OpenAI(base_url=governed + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=5)
    assert e.value.code == "rate_limit_exceeded"
    retry_after = int(e.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    t.join()


def test_client_honours_retry_after(governed):
    seen = []
    http = httpx.Client(event_hooks={"response": [lambda r: seen.append((time.monotonic(), r.status_code,
                                                                         r.headers.get("retry-after")))]})
    t = hold_the_only_slot(governed)
    client = openai.OpenAI(base_url=governed + "/v1", api_key="unused", max_retries=1, timeout=60,
                           http_client=http)
    try:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=5)
    except openai.RateLimitError:
        pass  # still busy after the wait: fine, the wait is what is checked
    t.join()
    assert len(seen) == 2, seen
    (t0, s0, ra0), (t1, _, _) = seen
    assert s0 == 429 and ra0 is not None
    # The client waited (about) Retry-After seconds before its retry.
    assert t1 - t0 >= 0.9 * int(ra0), seen
