"""`specserve serve` as a user runs it: a subprocess on the embedded default
pair with the speculation autopilot, driven by the official `openai` client.

The server runs in float32: with bf16 weights greedy text can change with the
K of each verify step (near-ties flip, see README), and the autopilot may pick
different K for two identical requests, so only float32 makes streaming and
non-streaming replies comparable token for token on every CPU.
"""

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
    command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32"]
    server = subprocess.Popen(
        command,
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
    # Whether speculation pays depends on the CPU: the autopilot decides, and
    # says what it did either way.
    speculation = (plain.model_extra or {})["speculation"]
    assert speculation["mode"] == "auto"
    assert sum(speculation["steps_by_k"].values()) > 0, speculation
    if speculation["applied"]:
        assert 0 < speculation["accepted_tokens"] <= speculation["draft_tokens"]
    else:
        assert speculation["reason"] in {"not_paying", "batch_too_large", "too_short"}, speculation
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

    # The startup calibration drafted, so the draft ran and vLLM counted it;
    # the autopilot counted every step by its K.
    assert total("vllm:spec_decode_num_draft_tokens_total") > 0
    assert total("specserve_draft_forward_passes_total") > 0
    assert total("specserve_speculation_steps_total") > 0
    accepted = total("specserve_spec_decode_accepted_tokens_total")
    assert 0 <= accepted <= total("specserve_spec_decode_draft_tokens_total")
    health = httpx.get(f"{base_url}/health", timeout=30).json()["details"]
    assert health["autopilot"]["cost_ready"] is True
