"""The official `openai` client against specserve on the real vLLM engine."""

import httpx
import openai
import pytest

from tests.integration.conftest import RunningServer

pytestmark = pytest.mark.integration


def client_for(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


async def test_models_lists_the_served_name(spec_server: RunningServer) -> None:
    models = await client_for(spec_server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_completion_with_every_parameter(spec_server: RunningServer) -> None:
    result = await client_for(spec_server).completions.create(
        model="tiny",
        prompt=["def add(a, b):", "The weather"],
        max_tokens=12,
        temperature=0.9,
        top_p=0.95,
        n=2,
        seed=7,
        logprobs=2,
        presence_penalty=0.3,
        frequency_penalty=0.3,
        user="tester",
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:
        assert choice.finish_reason in ("length", "stop")
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert result.usage is not None
    assert result.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in result.choices if c.logprobs is not None
    )


async def test_token_id_prompt_and_echo(spec_server: RunningServer) -> None:
    client = client_for(spec_server)
    text_prompt = "def add(a, b):"
    ids = spec_server.engine.tokenize(text_prompt)
    by_text = await client.completions.create(
        model="tiny", prompt=text_prompt, max_tokens=8, temperature=0
    )
    by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    echoed = await client.completions.create(
        model="tiny", prompt=text_prompt, max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == text_prompt + by_text.choices[0].text


async def test_seed_makes_sampling_reproducible(spec_server: RunningServer) -> None:
    client = client_for(spec_server)
    runs = [
        await client.completions.create(
            model="tiny", prompt="Once", max_tokens=16, temperature=1.0, seed=1234
        )
        for _ in range(2)
    ]
    assert runs[0].choices[0].text == runs[1].choices[0].text


async def test_stop_string_cuts_the_output(spec_server: RunningServer) -> None:
    client = client_for(spec_server)
    full = await client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=24, temperature=0
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = await client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


async def test_chat_streaming_and_plain_agree_at_temperature_zero(
    spec_server: RunningServer,
) -> None:
    client = client_for(spec_server)
    messages = [
        {"role": "system", "content": "You write code."},
        {"role": "user", "content": [{"type": "text", "text": "Write a function."}]},
    ]
    plain = await client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=20,
        temperature=0,
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=20,
        temperature=0,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and plain.usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


async def test_chat_logprobs(spec_server: RunningServer) -> None:
    result = await client_for(spec_server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


async def test_errors_reach_the_client_typed(spec_server: RunningServer) -> None:
    client = client_for(spec_server)
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.completions.create(model="other", prompt="x", max_tokens=1)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.completions.create(model="tiny", prompt="word " * 600, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )


# 16 sequences of 2000 tokens take the tiny engine several seconds: longer
# than the clients below stay connected.
LONG = 2000


async def test_engine_refusals_come_before_the_stream(spec_server: RunningServer) -> None:
    """vLLM refuses several greedy samples; the client must get a 400, not a 200
    followed by an error event."""
    body = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 4,
        "n": 2,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=spec_server.base_url, timeout=60) as http:
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "greedy" in response.json()["error"]["message"]


def _watch_aborts(server: RunningServer) -> list[str]:
    """Record the ids the adapter aborts, still calling the real abort."""
    aborted: list[str] = []
    engine = server.engine
    real_abort = engine.abort

    async def abort(request_id: str) -> None:
        aborted.append(request_id)
        await real_abort(request_id)

    engine.abort = abort  # type: ignore[method-assign]
    return aborted


# The adapter aborts only a request that has not finished, so one abort
# recorded proves the request was cut short, however fast the machine. The
# wait for the idle engine only stops a hang.
IDLE_SECONDS = 120.0


async def test_stream_disconnect_aborts_the_engine_request(plain_server: RunningServer) -> None:
    aborted = _watch_aborts(plain_server)
    body = {"model": "tiny", "prompt": "x", "max_tokens": LONG, "stream": True, "n": 16}
    async with (
        httpx.AsyncClient(base_url=plain_server.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break
    await plain_server.wait_engine_idle(IDLE_SECONDS)
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-")


async def test_non_streaming_disconnect_aborts_the_engine_request(
    plain_server: RunningServer,
) -> None:
    aborted = _watch_aborts(plain_server)
    body = {"model": "tiny", "prompt": "x", "max_tokens": LONG, "n": 16}
    async with httpx.AsyncClient(base_url=plain_server.base_url, timeout=1.0) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    await plain_server.wait_engine_idle(IDLE_SECONDS)
    assert len(aborted) == 1 and aborted[0].startswith("cmpl-")
