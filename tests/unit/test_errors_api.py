"""Every failure leaves in OpenAI's error shape with the right status code."""

import httpx
import pytest

from tests.unit.scripted_engine import ScriptedEngine
from tests.unit.sse import events

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"name": "answer", "schema": {"type": "object"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400)
    assert "JSON" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 3),
        ("top_p", 0),
        ("n", 0),
        ("max_tokens", 0),
        ("logprobs", 99),
        ("presence_penalty", 5),
        ("stream_options", {"bogus": True}),
    ],
)
async def test_invalid_values_are_400_naming_the_parameter(
    client: httpx.AsyncClient, field: str, value: object
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x", field: value}
    )
    error = assert_error(response, 400)
    assert error["param"].startswith(field)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"suffix": "end", "echo": True}, "suffix"),
        ({"suffix": "end", "prompt": [1, 2]}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
    ],
)
async def test_unsupported_completion_parameters_are_400(
    client: httpx.AsyncClient, extra: dict, words: str
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x", **extra}
    )
    assert words in assert_error(response, 400)["message"]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"speculation": {"max_draft_tokens": -1}}, "max_draft_tokens"),
        ({"speculation": {"k": 1}}, "k"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "not in tools",
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "send one of them",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "name"),
        ({"messages": [{"role": "assistant"}]}, "needs content"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "json_object", "json_schema": SCHEMA}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
    ],
)
async def test_unsupported_chat_features_are_400(
    client: httpx.AsyncClient, extra: dict, words: str
) -> None:
    response = await client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": USER, **extra}
    )
    assert words in assert_error(response, 400)["message"]


async def test_unknown_model_is_404_model_not_found(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    error = assert_error(response, 404, "model_not_found")
    assert error["param"] == "model"
    response = await client.get("/v1/models/gpt-9")
    assert_error(response, 404, "model_not_found")


async def test_prompt_longer_than_context_is_400_with_counts(client: httpx.AsyncClient) -> None:
    prompt = " ".join(["w"] * 70)
    response = await client.post("/v1/completions", json={"model": "scripted", "prompt": prompt})
    error = assert_error(response, 400, "context_length_exceeded")
    assert "64" in error["message"] and "70" in error["message"]


async def test_prompt_plus_max_tokens_over_context_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "a b c", "max_tokens": 62}
    )
    error = assert_error(response, 400, "context_length_exceeded")
    assert "65" in error["message"] and error["param"] == "max_tokens"


async def test_unknown_route_is_404_in_openai_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nothing"), 404)


async def test_wrong_method_keeps_its_status_in_openai_shape(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/completions"), 405)


async def test_error_after_the_stream_started_is_an_sse_event(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.fail_after = 2
    response = await client.post(
        "/v1/completions",
        json={"model": "scripted", "prompt": "x", "max_tokens": 5, "stream": True},
    )
    assert response.status_code == 200
    payloads = events(response.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["message"] == "scripted failure"
    assert [p["choices"][0]["text"] for p in payloads[:-2]] == ["Hello", " world"]


async def test_error_before_streaming_is_a_plain_status(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "nope", "prompt": "x", "stream": True}
    )
    assert_error(response, 404, "model_not_found")


async def test_engine_refusal_is_a_400_before_any_stream_starts(
    client: httpx.AsyncClient,
) -> None:
    for path, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": USER}),
    ):
        response = await client.post(
            path, json={"model": "scripted", "n": 2, "temperature": 0, "stream": True, **extra}
        )
        assert "greedy" in assert_error(response, 400)["message"]


async def test_out_of_range_seed_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x", "seed": 2**64}
    )
    assert assert_error(response, 400)["param"] == "seed"


async def test_null_means_the_default(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "model": "scripted",
            "prompt": "x",
            "temperature": None,
            "top_p": None,
            "n": None,
            "stop": None,
            "max_tokens": None,
        },
    )
    assert response.status_code == 200, response.text
    assert engine.requests[0].sampling.temperature == 1.0
    assert engine.requests[0].sampling.max_tokens == 16


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream_options": {"include_usage": True}}, None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": ["a", "x" * 257]}, "stop"),
        ({"prompt": ["p"] * 20, "n": 4}, None),
    ],
)
async def test_request_limits_are_400(
    client: httpx.AsyncClient, extra: dict, param: str | None
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x", **extra}
    )
    error = assert_error(response, 400)
    assert "Value error" not in error["message"]
    if param is not None:
        assert error["param"].startswith(param)


async def test_chat_message_name_is_refused_not_ignored(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "scripted", "messages": [{"role": "user", "content": "x", "name": "a"}]},
    )
    assert "name" in assert_error(response, 400)["message"]


async def test_chat_prompt_over_the_context_names_messages(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": " ".join(["w"] * 80)}]
    response = await client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": messages}
    )
    assert assert_error(response, 400, "context_length_exceeded")["param"] == "messages"
