"""The official `openai` Python client against `envelope serve` on loopback.

Run by scripts/test.sh in a virtual environment; ENVELOPE_BIN and
ENVELOPE_TEST_MODEL point at the binary and the SmolLM2 GGUF.
"""

import os
import subprocess
import threading

import openai
import pytest

BIN = os.environ.get("ENVELOPE_BIN", "target/release/envelope")
MODEL = os.environ.get("ENVELOPE_TEST_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def client():
    proc = subprocess.Popen(
        [BIN, "serve", "--model", MODEL, "--port", "0", "--kv-cache-bytes", "64MiB",
         "--served-model-name", "smollm2"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "ENVELOPE_LOG": "warn"},
    )
    url = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith("envelope serve listening on "):
                url.append(line.split()[-1])
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(120), "server did not start"
    yield openai.OpenAI(base_url=url[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    proc.terminate()
    proc.wait(30)


def test_completion(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_chat(client):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=40, temperature=0)
    assert "4" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"


def test_chat_streaming_with_usage(client):
    whole = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What color is the sky on a clear day?"}],
        max_tokens=30, temperature=0)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What color is the sky on a clear day?"}],
        max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    text = "".join(parts)
    assert text == whole.choices[0].message.content
    assert "blue" in text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert finish in ("stop", "length")


def test_completion_streaming(client):
    parts = [c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=16, temperature=0, stream=True) if c.choices]
    assert len("".join(parts)) > 0


def test_context_length_exceeded_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="hello " * 9000, max_tokens=10)
    assert e.value.code == "context_length_exceeded"
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=100000)
    assert e.value.code == "context_length_exceeded"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
