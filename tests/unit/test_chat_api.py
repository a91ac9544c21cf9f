"""POST /v1/chat/completions over the scripted engine."""

import httpx

from server.engine.contract import JsonFormat
from tests.unit.scripted_engine import ScriptedEngine
from tests.unit.sse import events

USER = [{"role": "user", "content": "hi"}]


async def test_chat_returns_an_assistant_message(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": USER, "max_tokens": 2}
    )
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


async def test_text_parts_and_roles_are_rendered(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "c"},
    ]
    response = await client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": messages, "max_tokens": 1}
    )
    assert response.status_code == 200
    # "system: be brief user: ab assistant: ok user: c" in whitespace tokens
    assert engine.requests[0].prompt_token_ids == [7, 2, 5, 5, 2, 10, 2, 5, 1]


async def test_a_json_schema_reaches_the_engine(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "scripted", "messages": USER, "response_format": response_format},
    )
    assert response.status_code == 200
    assert engine.requests[0].sampling.json_format == JsonFormat(schema)


async def test_max_completion_tokens_wins_over_max_tokens(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post(
        "/v1/chat/completions",
        json={"model": "scripted", "messages": USER, "max_tokens": 5, "max_completion_tokens": 2},
    )
    assert engine.requests[0].sampling.max_tokens == 2


async def test_without_a_limit_generation_may_fill_the_context(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post("/v1/chat/completions", json={"model": "scripted", "messages": USER})
    request = engine.requests[0]
    assert request.sampling.max_tokens == 64 - len(request.prompt_token_ids)


async def test_logprobs_carry_top_alternatives(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": "scripted",
            "messages": USER,
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "Hello"
    assert content[0]["bytes"] == list(b"Hello")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["Hello", "other"]


async def test_stream_puts_role_first_and_finish_reason_last(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "model": "scripted",
            "messages": USER,
            "max_tokens": 3,
            "stream": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = events(response.text)[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(m["delta"]["content"] or "" for m in mine) == "Hello world!"
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_a_request_s_draft_cap_reaches_the_engine(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    cap = {"speculation": {"max_draft_tokens": 0}}
    chat = {"model": "scripted", "messages": USER, **cap}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    completion = {"model": "scripted", "prompt": "x", **cap}
    assert (await client.post("/v1/completions", json=completion)).status_code == 200
    response = {"model": "scripted", "input": "x", **cap}
    assert (await client.post("/v1/responses", json=response)).status_code == 200
    plain = {"model": "scripted", "prompt": "x"}
    assert (await client.post("/v1/completions", json=plain)).status_code == 200
    assert [r.sampling.max_draft_tokens for r in engine.requests] == [0, 0, 0, None]
    assert all(r.sampling.lookups for r in engine.requests)


async def test_a_request_may_ask_for_the_draft_s_proposals_only(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    off = {"speculation": {"lookups": False}}
    for path, body in (
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/responses", {"input": "x"}),
    ):
        response = await client.post(path, json={"model": "scripted", **body, **off})
        assert response.status_code == 200, response.text
    assert [(r.sampling.lookups, r.sampling.max_draft_tokens) for r in engine.requests] == [
        (False, None)
    ] * 3
    bad = {"model": "scripted", "prompt": "x", "speculation": {"lookups": "maybe"}}
    assert (await client.post("/v1/completions", json=bad)).status_code == 400
