"""`specserve serve` as a user runs it: a subprocess on the embedded default
pair with the speculation autopilot, driven by the official `openai` client.

The server runs in float32: with bf16 weights greedy text can change with the
K of each verify step (near-ties flip, see README), and the autopilot may pick
different K for two identical requests, so only float32 makes streaming and
non-streaming replies comparable token for token on every CPU.
"""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel

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


def test_fill_in_the_middle_returns_the_middle(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="qwen2.5-coder-1.5b-instruct",
        prompt="def add(a, b):\n    return ",
        suffix="\n\n\nassert add(2, 3) == 5\n",
        max_tokens=8,
        temperature=0,
    )
    middle = result.choices[0].text
    assert "a + b" in middle or "a+b" in middle, middle


class Reversal(BaseModel):
    original: str
    reversed: str


def test_parse_returns_the_schema_s_object(client: openai.OpenAI) -> None:
    result = client.chat.completions.parse(
        model="qwen2.5-coder-1.5b-instruct",
        messages=[{"role": "user", "content": "Reverse the word 'stressed'. Answer in JSON."}],
        response_format=Reversal,
        max_tokens=32,
        temperature=0,
    )
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Reversal)
    assert parsed.original == "stressed"


def test_json_object_mode_replies_json(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="qwen2.5-coder-1.5b-instruct",
        messages=[{"role": "user", "content": 'Give {"a": 1, "b": 2} back as a JSON object.'}],
        response_format={"type": "json_object"},
        max_tokens=24,
        temperature=0,
    )
    assert isinstance(json.loads(result.choices[0].message.content or ""), dict)
