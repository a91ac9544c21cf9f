"""POST /v1/completions over the scripted engine: shapes, parameters, streaming."""

import httpx

from server.engine.contract import JsonFormat
from tests.unit.scripted_engine import ScriptedEngine
from tests.unit.sse import events


async def test_completion_returns_text_and_engine_usage(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "one two three", "max_tokens": 3}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": "Hello world!", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_many_prompts_and_n_give_one_choice_each(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    response = await client.post(
        "/v1/completions",
        json={"model": "scripted", "prompt": ["a b", "c"], "max_tokens": 2, "n": 2},
    )
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 8
    assert all(r.sampling.n == 2 for r in engine.requests)


async def test_token_id_prompts_are_passed_through(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": [[5, 6, 7], [8]], "max_tokens": 1}
    )
    assert response.status_code == 200
    assert [r.prompt_token_ids for r in engine.requests] == [[5, 6, 7], [8]]


async def test_token_ids_outside_vocabulary_are_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": [1, 5000], "max_tokens": 1}
    )
    assert response.status_code == 400
    assert "5000" in response.json()["error"]["message"]


async def test_sampling_parameters_reach_the_engine(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post(
        "/v1/completions",
        json={
            "model": "scripted",
            "prompt": "x",
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 11,
            "stop": ["!"],
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "user": "someone",
        },
    )
    sampling = engine.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (0.7, 0.9, 11)
    assert sampling.stop == ("!",)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)


async def test_suffix_asks_the_engine_to_fill_in_the_middle(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    response = await client.post(
        "/v1/completions",
        json={"model": "scripted", "prompt": ["ab c", "d"], "suffix": "efg", "max_tokens": 1},
    )
    assert response.status_code == 200
    # The scripted engine marks prefix, suffix and middle with token 0.
    assert [r.prompt_token_ids for r in engine.requests] == [[0, 2, 1, 0, 3, 0], [0, 1, 0, 3, 0]]


async def test_response_format_reaches_the_engine_as_a_json_constraint(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
    ]
    for response_format in formats:
        response = await client.post(
            "/v1/completions",
            json={"model": "scripted", "prompt": "x", "response_format": response_format},
        )
        assert response.status_code == 200
    assert [r.sampling.json_format for r in engine.requests] == [
        None,
        JsonFormat(),
        JsonFormat(schema),
    ]


async def test_stop_string_ends_the_choice(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x", "stop": "!", "max_tokens": 9}
    )
    choice = response.json()["choices"][0]
    assert choice["text"] == "Hello world"
    assert choice["finish_reason"] == "stop"


async def test_a_long_stop_string_is_one_sequence_not_over_the_limit(
    client: httpx.AsyncClient,
) -> None:
    # The four-sequence limit counts list items, never a string's characters.
    body = {"model": "scripted", "prompt": "x", "stop": " world", "max_tokens": 9}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "Hello"


async def test_echo_prepends_the_prompt(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={"model": "scripted", "prompt": "hi there", "echo": True, "max_tokens": 1},
    )
    assert response.json()["choices"][0]["text"] == "hi thereHello"


async def test_logprobs_follow_the_legacy_shape(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x", "logprobs": 2, "max_tokens": 2}
    )
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hello", " world"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {"Hello": -0.5, "other": -1.5}
    assert logprobs["text_offset"] == [0, 5]


async def test_stream_sends_chunks_usage_and_done(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={
            "model": "scripted",
            "prompt": "a b",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = events(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello world!"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_stream_without_usage_option_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/completions",
        json={"model": "scripted", "prompt": "a", "max_tokens": 2, "stream": True},
    )
    chunks = events(response.text)[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert all(c["choices"] for c in chunks)
