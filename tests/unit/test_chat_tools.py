"""Tool calling on POST /v1/chat/completions over the scripted engine: what reaches
the template and the grammar, and how replies become calls, whole and streamed."""

import json

import httpx

from server.engine.contract import JsonFormat
from tests.unit.scripted_engine import ScriptedEngine
from tests.unit.sse import events

USER = [{"role": "user", "content": "weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now"}}
CALL_WORDS = [
    "Let me check.",
    '<call>{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}</call>',
]


async def chat(client: httpx.AsyncClient, **extra: object) -> httpx.Response:
    body = {"model": "scripted", "messages": USER, "tools": [WEATHER, TIME], **extra}
    return await client.post("/v1/chat/completions", json=body)


async def test_auto_renders_the_tools_and_parses_the_call(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = CALL_WORDS
    body = (await chat(client)).json()
    assert engine.rendered_tools == [
        WEATHER,
        {"type": "function", "function": {**TIME["function"], "parameters": {"type": "object"}}},
    ]
    assert engine.requests[0].sampling.json_format is None
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_auto_without_a_call_is_a_plain_reply(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    body = (await chat(client, max_tokens=2)).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["choices"][0]["finish_reason"] == "length"


async def test_streamed_call_sends_id_and_name_first_and_reassembles(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = CALL_WORDS
    response = await chat(client, stream=True)
    chunks = events(response.text)[:-1]
    deltas = [c["choices"][0] for c in chunks]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    pieces = [p for d in deltas for p in d["delta"].get("tool_calls") or []]
    assert content == "Let me check."
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
    arguments = "".join(p["function"].get("arguments", "") for p in pieces)
    assert json.loads(arguments) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_named_function_is_held_to_its_schema(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = ['{"city": ', '"Rome"}']
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = (await chat(client, tool_choice=choice)).json()
    assert engine.requests[0].sampling.json_format == JsonFormat(CITY, param="tools")
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert body["choices"][0]["message"]["content"] is None


async def test_named_function_streams_the_arguments_as_they_come(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = ['{"city": ', '"Rome"}']
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = await chat(client, tool_choice=choice, stream=True)
    chunks = events(response.text)[:-1]
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [p["function"].get("arguments") for p in pieces] == ['{"city": ', '"Rome"}']
    assert pieces[0]["function"]["name"] == "get_weather"


async def test_required_asks_for_an_array_of_calls(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = [
        '[{"name": "get_time", "parameters": {}}, ',
        '{"name": "get_weather", ',
        '"parameters": {"city": "Oslo"}}]',
    ]
    body = (await chat(client, tool_choice="required")).json()
    schema = engine.requests[0].sampling.json_format.schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]


async def test_required_without_parallel_calls_allows_one(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.script = ['[{"name": "get_time", "parameters": {}}]']
    await chat(client, tool_choice="required", parallel_tool_calls=False)
    assert engine.requests[0].sampling.json_format.schema["maxItems"] == 1


async def test_none_hides_the_tools(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    engine.script = CALL_WORDS
    body = (await chat(client, tool_choice="none")).json()
    assert engine.rendered_tools is None
    assert "tool_calls" not in body["choices"][0]["message"]


async def test_history_with_calls_and_results_reaches_the_template(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "scripted", "messages": messages, "tools": [WEATHER]},
    )
    assert response.status_code == 200
    # Templates write arguments with tojson: they get an object, not JSON text.
    assert engine.rendered_messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


async def test_a_call_cut_off_by_max_tokens_is_text_streamed_and_not(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    # The call never closes: the whole reply has no call, so the stream must not send one.
    engine.script = CALL_WORDS
    whole = (await chat(client, max_tokens=2)).json()["choices"][0]
    assert "tool_calls" not in whole["message"] and whole["finish_reason"] == "length"
    response = await chat(client, max_tokens=2, stream=True)
    deltas = [c["choices"][0] for c in events(response.text)[:-1]]
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == whole["message"]["content"]
