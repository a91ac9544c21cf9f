"""POST /v1/responses over the scripted engine: what reaches the template, the grammar
and the engine, the response object and the typed stream events (each checked
against the official SDK's models), refusals, and the SDKs that drive it."""

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2
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
from openai.types.responses import Response, ResponseStreamEvent
from prometheus_client import REGISTRY
from pydantic import TypeAdapter

from server.app import create_app
from server.engine.contract import JsonFormat
from tests.unit.scripted_engine import ScriptedEngine

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}
TIME = {"type": "function", "name": "get_time", "description": "now"}
CALL_WORDS = [
    "Let me check.",
    '<call>{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}</call>',
]
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


async def create(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await client.post("/v1/responses", json={"model": "scripted", "input": "hi", **fields})


async def respond(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await create(client, **fields)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    Response.model_validate(body, strict=True)  # every field the SDK's model requires
    return body


async def stream_events(client: httpx.AsyncClient, **fields: Any) -> list[dict[str, Any]]:
    """The stream's events, each checked against its SDK model and its `event:` line."""
    response = await create(client, stream=True, **fields)
    assert response.status_code == 200
    events = []
    for block in response.text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        STREAM_EVENT.validate_python(data, strict=True)
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def calls(body: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (item["name"], json.loads(item["arguments"]))
        for item in body["output"]
        if item["type"] == "function_call"
    ]


async def test_a_string_input_gets_one_message(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    body = await respond(client, metadata={"run": "1"}, user="u")
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "completed" and body["incomplete_details"] is None
    [message] = body["output"]
    assert message["id"].startswith("msg_") and message["status"] == "completed"
    assert message["role"] == "assistant"
    assert message["content"] == [
        {"type": "output_text", "text": "Hello world! How are you?", "annotations": []}
    ]
    assert Response.model_validate(body).output_text == "Hello world! How are you?"
    assert body["usage"]["input_tokens"] == 2 and body["usage"]["output_tokens"] == 7
    assert body["usage"]["total_tokens"] == 9
    assert body["speculation"]["accepted_tokens"] == 4
    assert (body["store"], body["metadata"], body["user"]) == (False, {"run": "1"}, "u")
    assert (body["tool_choice"], body["tools"], body["text"]) == (
        "auto",
        [],
        {"format": {"type": "text"}},
    )
    assert engine.rendered_messages == [{"role": "user", "content": "hi"}]


async def test_max_output_tokens_cuts_the_reply_incomplete(client: httpx.AsyncClient) -> None:
    body = await respond(client, max_output_tokens=2)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == "Hello world"


async def test_instructions_and_input_items_reach_the_template(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    items = [
        {"role": "developer", "content": "be brief"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        # An earlier output item sent back as it came.
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "ok", "annotations": []}],
        },
        {"role": "user", "content": "c"},
    ]
    body = await respond(client, instructions="You help.", input=items)
    assert body["instructions"] == "You help."
    assert engine.rendered_messages == [
        {"role": "system", "content": "You help."},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "c"},
    ]


async def test_calls_and_their_outputs_become_tool_turns(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    items = [
        {"role": "user", "content": "weather in Paris and the time?"},
        {"role": "assistant", "content": "Checking."},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "status": "completed",
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
    ]
    await respond(client, input=items, tools=[WEATHER, TIME])
    # One assistant turn holds the text and both calls; templates get arguments as objects.
    assert engine.rendered_messages[1:] == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {}},
                },
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2"},
    ]


async def test_a_call_without_text_starts_an_assistant_turn(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    items = [
        {"role": "user", "content": "time?"},
        {"type": "function_call", "call_id": "call_9", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "noon"},
    ]
    await respond(client, input=items)
    assert engine.rendered_messages[1]["role"] == "assistant"
    assert engine.rendered_messages[1]["content"] == ""
    assert [c["id"] for c in engine.rendered_messages[1]["tool_calls"]] == ["call_9"]


@pytest.mark.parametrize(
    ("text_format", "expected"),
    [
        ({"type": "json_schema", "name": "city", "schema": CITY, "strict": True}, JsonFormat(CITY)),
        ({"type": "json_object"}, JsonFormat()),
        ({"type": "text"}, None),
    ],
)
async def test_text_format_reaches_the_engine(
    client: httpx.AsyncClient,
    engine: ScriptedEngine,
    text_format: dict[str, Any],
    expected: JsonFormat | None,
) -> None:
    body = await respond(client, text={"format": text_format})
    assert engine.requests[0].sampling.json_format == expected
    # Echoed with OpenAI's spelling (`schema`), as the SDK's model reads it.
    assert {k: v for k, v in body["text"]["format"].items() if v is not None} == text_format


async def test_auto_renders_the_tools_and_parses_the_call(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = CALL_WORDS
    body = await respond(client, tools=[WEATHER, TIME])
    assert engine.rendered_tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "now",
                "parameters": {"type": "object"},
            },
        },
    ]
    assert engine.requests[0].sampling.json_format is None
    message, call = body["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert calls(body) == [("get_weather", {"city": "Paris"})]
    assert [t["name"] for t in body["tools"]] == ["get_weather", "get_time"]


async def test_a_named_function_is_held_to_its_schema(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = ['{"city": ', '"Rome"}']
    choice = {"type": "function", "name": "get_weather"}
    body = await respond(client, tools=[WEATHER, TIME], tool_choice=choice)
    assert engine.requests[0].sampling.json_format == JsonFormat(CITY, param="tools")
    assert [item["type"] for item in body["output"]] == ["function_call"]
    assert calls(body) == [("get_weather", {"city": "Rome"})]
    assert body["tool_choice"] == choice


async def test_required_asks_for_a_list_of_calls(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = [
        '[{"name": "get_time", "parameters": {}}, ',
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    ]
    body = await respond(client, tools=[WEATHER, TIME], tool_choice="required")
    schema = engine.requests[0].sampling.json_format.schema
    assert schema["type"] == "array" and "maxItems" not in schema
    assert calls(body) == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    await respond(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert engine.requests[1].sampling.json_format.schema["maxItems"] == 1


async def test_none_hides_the_tools(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = CALL_WORDS
    body = await respond(client, tools=[WEATHER], tool_choice="none")
    assert engine.rendered_tools is None
    assert [item["type"] for item in body["output"]] == ["message"]


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


async def test_streamed_text_events_in_order_add_up_to_the_response(
    client: httpx.AsyncClient,
) -> None:
    events = await stream_events(client, max_output_tokens=3)
    assert _types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "incomplete",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None
    assert final["id"] == created["id"] and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    added = events[2]["item"]
    assert added["status"] == "in_progress" and added["content"] == []
    assert "".join(e["delta"] for e in events if "delta" in e) == "Hello world!"
    assert all(e["item_id"] == added["id"] for e in events[3:9])
    [message] = final["output"]
    assert message == events[-2]["item"]
    assert message["id"] == added["id"] and message["status"] == "incomplete"
    assert message["content"][0]["text"] == events[7]["text"] == "Hello world!"
    assert final["usage"]["output_tokens"] == 3 and final["speculation"]["applied"]


async def test_a_streamed_call_follows_its_text(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = CALL_WORDS
    events = await stream_events(client, tools=[WEATHER])
    assert _types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    call = events[8]["item"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_weather", "")
    assert events[8]["output_index"] == events[9]["output_index"] == 1
    assert json.loads(events[10]["arguments"]) == {"city": "Paris"}
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == call["call_id"]
    assert calls(final) == [("get_weather", {"city": "Paris"})]


async def test_a_named_call_streams_its_arguments_as_they_come(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = ['{"city": ', '"Rome"}']
    events = await stream_events(
        client, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}
    )
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"city": ', '"Rome"}']
    assert calls(events[-1]["response"]) == [("get_weather", {"city": "Rome"})]


async def test_an_error_mid_stream_is_the_last_event() -> None:
    engine = ScriptedEngine(fail_after=2)
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        events = await stream_events(client)
    assert events[-1] == {
        "type": "error",
        "sequence_number": len(events) - 1,
        "code": "server_error",
        "message": "scripted failure",
        "param": None,
    }
    assert events[-2]["type"] == "response.output_text.delta"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [WEATHER, {"type": "file_search"}]}, "tools", "file_search"),
        ({"tools": [{"type": ["function"], "name": "f"}]}, "tools", "'function'"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "unsupported parameter"),
        ({"include": ["message.output_text.logprobs"]}, "include", "no extra output"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "input items are"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
        ({"input": []}, "input", "at least 1"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"stream_options": {"include_obfuscation": False}}, None, "stream is true"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"tool_choice": "required"}, None, "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            None,
            "not in tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            None,
            "text.format and a required",
        ),
        ({"max_output_tokens": 100}, "max_output_tokens", "maximum context length"),
    ],
)
async def test_what_specserve_cannot_honour_is_a_400_naming_it(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str | None, words: str
) -> None:
    response = await create(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert error["param"] == param or (param and error["param"].startswith(param))


async def test_store_is_accepted_and_nothing_is_stored(client: httpx.AsyncClient) -> None:
    body = await respond(client, store=True, stream_options=None)
    assert body["store"] is False and body["previous_response_id"] is None


async def test_requests_are_counted_under_their_endpoint(client: httpx.AsyncClient) -> None:
    labels = {"endpoint": "/v1/responses", "status": "200"}
    before = REGISTRY.get_sample_value("specserve_requests_total", labels) or 0.0
    await respond(client, max_output_tokens=2)
    assert REGISTRY.get_sample_value("specserve_requests_total", labels) == before + 1
    tokens = {"model": "scripted", "endpoint": "/v1/responses", "tenant": "anonymous"}
    assert REGISTRY.get_sample_value("specserve_generation_tokens_total", tokens)


@pytest.fixture
async def sdk(engine: ScriptedEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client over the app, validating every response strictly."""
    transport = httpx2.ASGITransport(app=create_app(engine))
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key="unused",
            http_client=http,
            max_retries=0,
            _strict_response_validation=True,
        )


async def test_the_sdk_parses_the_response_and_both_stream_helpers(
    sdk: openai.AsyncOpenAI, engine: ScriptedEngine
) -> None:
    engine.script = CALL_WORDS
    request: dict[str, Any] = {"model": "scripted", "input": "hi", "tools": [WEATHER]}
    whole = await sdk.responses.create(**request)
    assert whole.output_text == "Let me check."
    assert [item.type for item in whole.output] == ["message", "function_call"]

    stream = await sdk.responses.create(**request, stream=True)
    types = [event.type async for event in stream]
    assert types[0] == "response.created" and types[-1] == "response.completed"

    async with sdk.responses.stream(**request) as managed:
        async for _ in managed:
            pass
        final = await managed.get_final_response()
    assert final.output_text == "Let me check."
    [call] = [item for item in final.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_an_agent_calls_its_tool_then_answers(
    sdk: openai.AsyncOpenAI, engine: ScriptedEngine, api: str
) -> None:
    # What the Agents SDK sends back (its own serialisation of our output items and
    # of the tool's result) must be accepted; the real model runs in tests/e2e.
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        engine.script = ["It is", " sunny in", " Paris."]
        return f"sunny in {city}"

    engine.script = ['<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>']
    model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="weather",
        instructions="Answer with the get_weather tool.",
        model=model_class(model="scripted", openai_client=sdk),
        model_settings=ModelSettings(temperature=0),
        tools=[get_weather],
    )
    result = await Runner.run(
        agent, "Weather in Paris?", run_config=RunConfig(tracing_disabled=True)
    )
    assert asked == ["Paris"]
    assert result.final_output == "It is sunny in Paris."
    history = engine.rendered_messages
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool"]
    assert history[3]["content"] == "sunny in Paris"
