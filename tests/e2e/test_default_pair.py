"""`specserve serve` as a user runs it: a subprocess on the embedded default
pair with speculation, driven by the official `openai` client."""

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.net import free_port, wait_until_up

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT_SECONDS = 900
MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(server, f"{url}/health", STARTUP_TIMEOUT_SECONDS)
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def test_serves_the_embedded_target_with_speculation(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["qwen2.5-coder-1.5b-instruct"]


def test_chat_writes_python_and_streaming_agrees(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model="qwen2.5-coder-1.5b-instruct",
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,  # type: ignore[arg-type]
    )
    text = plain.choices[0].message.content or ""
    assert "def " in text
    speculation = (plain.model_extra or {})["speculation"]
    assert speculation["applied"] is True
    assert 0 < speculation["accepted_tokens"] <= speculation["draft_tokens"]
    stream = client.chat.completions.create(
        model="qwen2.5-coder-1.5b-instruct",
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == text


def test_metrics_show_the_speculation(base_url: str, client: openai.OpenAI) -> None:
    client.completions.create(
        model="qwen2.5-coder-1.5b-instruct", prompt="def fib(n):", max_tokens=16, temperature=0
    )
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }

    def total(prefix: str) -> float:
        return sum(value for name, value in samples.items() if name.startswith(prefix))

    assert total("vllm:spec_decode_num_draft_tokens_total") > 0
    assert total("specserve_spec_decode_draft_tokens_total") > 0
    accepted = total("specserve_spec_decode_accepted_tokens_total")
    assert 0 < accepted <= total("specserve_spec_decode_draft_tokens_total")
