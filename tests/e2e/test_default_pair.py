"""`specserve serve` as a user runs it: a subprocess on the embedded default
pair with the speculation autopilot, driven by the official `openai` client.

The server runs in float32: with bf16 weights greedy text can change with the
K of each verify step (near-ties flip, see docs/speculation.md), and the autopilot may pick
different K for two identical requests, so only float32 makes streaming and
non-streaming replies comparable token for token on every CPU.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from pydantic import BaseModel

from loadtest.launch import wait_until_up
from tests.net import free_port

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT_SECONDS = 900
METRICS_PORT = free_port()
MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--metrics-port", str(METRICS_PORT), "--dtype", "float32"]
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
    # says what it did either way. What it verified may all have been rejected (a
    # lookup or a probe alone), so the counts must agree, not show acceptance.
    speculation = (plain.model_extra or {})["speculation"]
    assert speculation["mode"] == "auto"
    assert sum(speculation["steps_by_k"].values()) > 0, speculation
    if speculation["applied"]:
        accepted = speculation["accepted_tokens"]
        assert 0 < speculation["drafts"] <= speculation["draft_tokens"], speculation
        assert accepted <= speculation["draft_tokens"], speculation
        assert sum(speculation["accepted_per_position"]) == accepted, speculation
        by_source = speculation["by_source"].values()
        assert sum(source["accepted_tokens"] for source in by_source) == accepted, speculation
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


async def test_a_seeded_request_repeats_alone_and_beside_others(base_url: str) -> None:
    """The autopilot picks K from measured step times and the batch; a seeded reply must not
    follow it (seeded_sampling.py)."""
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    seeded = {
        "model": "qwen2.5-coder-1.5b-instruct",
        "messages": MESSAGES,
        "max_tokens": 32,
        "temperature": 1.0,
        "seed": 1234,
    }
    others = [
        {**seeded, "seed": None, "messages": [{"role": "user", "content": prompt}]}
        for prompt in ("Write a haiku about rain.", "Explain TCP briefly.", "Sort a list in C.")
    ]
    alone = await client.chat.completions.create(**seeded)
    beside, *_ = await asyncio.gather(
        client.chat.completions.create(**seeded),
        *(client.chat.completions.create(**other) for other in others),
    )
    assert beside.choices[0].message.content == alone.choices[0].message.content
    await client.close()


def test_metrics_show_the_speculation(base_url: str, client: openai.OpenAI) -> None:
    client.completions.create(
        model="qwen2.5-coder-1.5b-instruct", prompt="def fib(n):", max_tokens=16, temperature=0
    )
    assert httpx.get(f"{base_url}/metrics", timeout=30).status_code == 404  # on its own port
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text
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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_required_tool_call_round_trip_and_its_stream(client: openai.OpenAI) -> None:
    # tool_choice "required": the grammar makes the call. Under "auto" this coder
    # model writes a ```json block rather than Qwen's <tool_call> format (see docs/api.md).
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = {
        "model": "qwen2.5-coder-1.5b-instruct",
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "max_tokens": 48,
        "temperature": 0,
    }
    result = client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert result.choices[0].finish_reason == "tool_calls"
    [call] = result.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    stream = client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
    pieces = [
        p for chunk in stream if chunk.choices for p in chunk.choices[0].delta.tool_calls or []
    ]
    assert pieces[0].function and pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == (
        call.function.arguments
    )

    history = [
        *messages,
        result.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model="qwen2.5-coder-1.5b-instruct",
        messages=history,  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0,
    )
    assert "sunny" in (answer.choices[0].message.content or "").lower()


# The Responses API's flat function tool.
WEATHER_FUNCTION = {"type": "function", **WEATHER_TOOL["function"]}
# Without them the model repeats the call as text after reading the result.
WEATHER_INSTRUCTIONS = (
    "You are a weather assistant. Use the get_weather tool, then tell the user the weather "
    "it reported."
)
PARIS_WEATHER = "Paris: sunny, 23 degrees Celsius"


def test_responses_call_a_tool_and_answer_with_its_result(client: openai.OpenAI) -> None:
    # tool_choice "required": under "auto" this model writes the call as text (see docs/api.md).
    question = {"role": "user", "content": "What is the weather in Paris?"}
    request = {
        "model": "qwen2.5-coder-1.5b-instruct",
        "instructions": WEATHER_INSTRUCTIONS,
        "input": [question],
        "tools": [WEATHER_FUNCTION],
        "tool_choice": "required",
        "max_output_tokens": 48,
        "temperature": 0,
    }
    result = client.responses.create(**request)  # type: ignore[call-overload]
    [call] = result.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}

    with client.responses.stream(**request) as stream:  # type: ignore[call-overload]
        streamed = stream.get_final_response()
    assert [(c.type, c.arguments) for c in streamed.output] == [("function_call", call.arguments)]

    answer = client.responses.create(
        model="qwen2.5-coder-1.5b-instruct",
        instructions=WEATHER_INSTRUCTIONS,
        input=[  # type: ignore[list-item]
            question,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": PARIS_WEATHER},
        ],
        tools=[WEATHER_FUNCTION],  # type: ignore[list-item]
        max_output_tokens=48,
        temperature=0,
    )
    assert [item.type for item in answer.output] == ["message"]
    assert "23" in answer.output_text and "sunny" in answer.output_text.lower()


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
async def test_an_agent_calls_its_tool_and_answers_with_the_result(
    base_url: str, model_class: type[OpenAIResponsesModel] | type[OpenAIChatCompletionsModel]
) -> None:
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        asked.append(city)
        return PARIS_WEATHER if city == "Paris" else f"{city}: unknown"

    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    agent = Agent(
        name="weather",
        instructions=WEATHER_INSTRUCTIONS,
        model=model_class(model="qwen2.5-coder-1.5b-instruct", openai_client=client),
        # "required" for the first turn: under "auto" this model writes the call as text.
        # The SDK resets tool_choice after the call (reset_tool_choice), so the next turn
        # may answer in text.
        model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"),
        tools=[get_weather],
    )
    result = await Runner.run(
        agent,
        "What is the weather in Paris?",
        max_turns=3,
        run_config=RunConfig(tracing_disabled=True),
    )
    assert asked == ["Paris"]
    assert "23" in result.final_output and "sunny" in result.final_output.lower()
