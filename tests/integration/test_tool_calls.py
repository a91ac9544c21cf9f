"""Tool calling on the real engine, through the official client.

The tiny models are random and never choose a tool by themselves, so these tests
take the grammar paths (a named function, `required`), where the arguments are
bounded by their schema and must parse; `auto` with a model that does call tools
runs in tests/e2e on the default pair. vLLM's own hermes parser, which reads
`auto` replies, is checked here on text in its format.
"""

import json

import jsonschema
import pytest

from server.engine.tool_calls import VllmToolCallParser, parser_class
from tests.integration.conftest import RunningServer, TinyModels
from tests.integration.test_openai_client import client_for

pytestmark = pytest.mark.integration

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "boolean"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast", "parameters": CITY},
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_a_named_call_round_trip_streamed_and_not(self_draft_server: RunningServer) -> None:
    # The target drafting for itself: drafts are verified under the grammar and accepted.
    client = client_for(self_draft_server)
    request = {
        "model": "tiny-self",
        "messages": MESSAGES,
        "tools": [WEATHER, CLOCK],
        "tool_choice": NAMED,
        "max_tokens": 64,
        "temperature": 0,
    }
    whole = await client.chat.completions.create(**request)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    assert (whole.model_extra or {})["speculation"]["accepted_tokens"] > 0

    stream = await client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
    pieces = [
        piece
        async for chunk in stream
        if chunk.choices
        for piece in chunk.choices[0].delta.tool_calls or []
    ]
    assert pieces[0].id and pieces[0].function and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == (
        call.function.arguments
    )

    # The result goes back as a tool message; the reply after it is plain text.
    history = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    answer = await client.chat.completions.create(
        model="tiny-self",
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        max_tokens=8,
        temperature=0,
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


async def test_required_gives_calls_that_parse(spec_server: RunningServer) -> None:
    result = await client_for(spec_server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    assert result.choices[0].finish_reason == "tool_calls"
    [call] = result.choices[0].message.tool_calls or []
    schema = {"get_weather": CITY, "get_time": CLOCK["function"]["parameters"]}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


async def test_greedy_calls_are_the_same_with_speculation_on_and_off(
    spec_server: RunningServer, plain_server: RunningServer
) -> None:
    calls = []
    for server in (spec_server, plain_server):
        result = await client_for(server).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "And in Oslo?"}],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=NAMED,  # type: ignore[arg-type]
            max_tokens=64,
            temperature=0,
        )
        [call] = result.choices[0].message.tool_calls or []
        calls.append(call.function.arguments)
    assert calls[0] == calls[1]


def test_vllm_hermes_parser_reads_calls_and_streams_the_text_before_them(tiny: TinyModels) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.target)
    hermes = parser_class("hermes")
    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    )
    whole = VllmToolCallParser(hermes, tokenizer).parse(text)
    assert whole.content == "Checking.\n"
    assert [(name, json.loads(arguments)) for name, arguments in whole.calls] == [
        ("get_weather", {"city": "Rome"}),
        ("get_time", {"utc": True}),
    ]

    # Streamed, the parser sends the text before the calls and holds back what could
    # start one; the calls themselves go out once parsed (serving/tools.py).
    streaming = VllmToolCallParser(hermes, tokenizer)
    sent = []
    for start in range(0, len(text), 5):  # 5-character deltas cut the tags apart
        piece = text[start : start + 5]
        sent.append(streaming.feed(piece, tokenizer.encode(piece, add_special_tokens=False)))
    assert "".join(sent) == "Checking.\n"
