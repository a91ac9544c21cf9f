"""Prompt caching on the real engine, as the official `openai` client sees it: cached_tokens in
chat, streamed and Responses usage, tenants kept apart by their cache salts, nothing cached with
prefix caching off, and the draft's KV right after a prefill served from the cache, as the
autopilot's scheduler prices it."""

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from server.traffic.api_keys import ApiKeys, KeyRing
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config

pytestmark = pytest.mark.integration

BLOCK = 32  # the smallest block vLLM's CPU attention runs
KEYS = {"sk-cache-alpha-0123": "team-a", "sk-cache-beta-45678": "team-b"}
ALPHA, BETA = KEYS


@pytest.fixture(scope="module")
def cache_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "steps.jsonl"


@pytest.fixture(scope="module")
async def cache_server(tiny: TinyModels, cache_trace: Path) -> AsyncIterator[RunningServer]:
    """The target drafting for itself (every draft whose KV is right is accepted), 32-token
    blocks, prefix caching on, one tenant per API key, its steps traced."""
    config = tiny_engine_config(
        tiny,
        tiny.target,
        served_model_name="tiny-cache",
        block_size=BLOCK,
        speculation_trace=cache_trace,
    )
    async for running in serve(config, api_keys=ApiKeys(KeyRing(KEYS))):
        yield running


@pytest.fixture(scope="module")
async def uncached_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    config = tiny_engine_config(
        tiny, None, served_model_name="tiny-uncached", block_size=BLOCK, prefix_caching=False
    )
    async for running in serve(config):
        yield running


def _client(server: RunningServer, key: str = ALPHA) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _system() -> str:
    """A system prompt no earlier request sent (so its first request finds nothing cached),
    several blocks long."""
    return f"Session {uuid.uuid4().hex}. " + "You answer questions about Python code. " * 12


async def _chat(
    client: openai.AsyncOpenAI, model: str, system: str, question: str, **extra: Any
) -> Any:
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        **extra,
    )


async def _draft_counts(server: RunningServer) -> dict[str, Any]:
    """The draft's cumulative counts, once the engine is idle."""
    await server.wait_engine_idle(60)
    feed = server.engine._feed
    assert feed is not None
    return dict(feed.draft())


def _cached(usage: Any) -> int:
    return int(usage.prompt_tokens_details.cached_tokens)


async def test_cached_tokens_zero_first_then_the_shared_prefix(
    cache_server: RunningServer,
) -> None:
    client, model, system = _client(cache_server), cache_server.model, _system()
    first = (await _chat(client, model, system, "What is a list?")).usage
    second = (await _chat(client, model, system, "What is a dict?")).usage
    assert _cached(first) == 0
    assert 0 < _cached(second) <= second.prompt_tokens
    assert _cached(second) % BLOCK == 0  # whole blocks

    stream = await _chat(
        client, model, system, "What is a set?", stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1
    assert 0 < _cached(usage[0]) <= usage[0].prompt_tokens


async def test_responses_usage_reports_what_the_engine_reused(
    cache_server: RunningServer,
) -> None:
    client, model, instructions = _client(cache_server), cache_server.model, _system()
    first = await client.responses.create(
        model=model, instructions=instructions, input="What is a tuple?", max_output_tokens=8
    )
    again = await client.responses.create(
        model=model, instructions=instructions, input="What is a tuple?", max_output_tokens=8
    )
    assert first.usage is not None and again.usage is not None
    assert first.usage.input_tokens_details.cached_tokens == 0
    # The same prompt again: every whole block but the one holding its last token, which is
    # computed again to sample the first output token.
    tokens = again.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == (tokens - 1) // BLOCK * BLOCK


async def test_one_tenant_never_reuses_another_tenants_prefix(
    cache_server: RunningServer,
) -> None:
    alpha, beta = _client(cache_server, ALPHA), _client(cache_server, BETA)
    model, system = cache_server.model, _system()
    assert _cached((await _chat(alpha, model, system, "What is a list?")).usage) == 0
    # team-b sends team-a's very prompt: nothing of it is cached for team-b...
    assert _cached((await _chat(beta, model, system, "What is a list?")).usage) == 0
    # ...while each tenant hits its own.
    assert _cached((await _chat(beta, model, system, "What is a dict?")).usage) > 0
    assert _cached((await _chat(alpha, model, system, "What is a dict?")).usage) > 0


async def test_drafts_after_a_cached_prefill_are_all_accepted(
    cache_server: RunningServer,
) -> None:
    """The first request asks for no drafts, so the draft idles through its prefill and its
    KV in the cached blocks is never written; the second reuses those blocks. The draft is the
    target itself: only a draft that caught up on the cached prefix has every draft accepted."""
    client, model, system = _client(cache_server), cache_server.model, _system()
    question = "Write a function that adds two numbers."
    off = await _chat(
        client, model, system, question, extra_body={"speculation": {"max_draft_tokens": 0}}
    )
    assert (off.model_extra or {})["speculation"]["draft_tokens"] == 0
    on = await _chat(client, model, system, question)
    assert _cached(on.usage) > 0
    speculation = (on.model_extra or {})["speculation"]
    assert speculation["draft_tokens"] > 0
    assert speculation["accepted_tokens"] == speculation["draft_tokens"]
    assert on.choices[0].message.content == off.choices[0].message.content


async def test_the_scheduler_prices_the_draft_s_catch_up_on_a_cached_prefix_it_never_wrote(
    cache_server: RunningServer, cache_trace: Path
) -> None:
    """The first request's prefill ran without the draft (an agent's earlier turn where the
    draft did not pay); the second reuses its blocks. What the scheduler counted of the
    draft's catch-up in the steps that ran the draft (a prompt chunk's own positions aside,
    which vLLM's proposer computes) is what the draft caught up on: the cached prefix."""
    client, model, system = _client(cache_server), cache_server.model, _system()
    question = "Write a function that multiplies two numbers."
    await _chat(
        client, model, system, question, extra_body={"speculation": {"max_draft_tokens": 0}}
    )
    before = await _draft_counts(cache_server)
    traced = len(cache_trace.read_text().splitlines())
    on = await _chat(client, model, system, question)
    after = await _draft_counts(cache_server)
    steps = [json.loads(line) for line in cache_trace.read_text().splitlines()[traced:]]
    priced = sum(step["caught_up"] - step["prefill_tokens"] for step in steps if step["k"])
    caught_up = after["draft_caught_up_tokens"] - before["draft_caught_up_tokens"]
    assert caught_up >= _cached(on.usage) > 0
    assert priced == caught_up


async def test_the_draft_does_not_prefill_a_cached_prefix_it_wrote_again(
    cache_server: RunningServer,
) -> None:
    """Drafts on for both: the first request's prefill wrote the draft's KV into the blocks the
    second reuses, so the second's draft has nothing to catch up on."""
    client, model, system = _client(cache_server), cache_server.model, _system()
    await _chat(client, model, system, "What is a list?")
    before = await _draft_counts(cache_server)
    reply = await _chat(client, model, system, "What is a dict?")
    after = await _draft_counts(cache_server)
    assert _cached(reply.usage) > 0
    assert after["draft_caught_up_tokens"] == before["draft_caught_up_tokens"]
    speculation = (reply.model_extra or {})["speculation"]
    assert speculation["accepted_tokens"] == speculation["draft_tokens"] > 0


async def test_no_prefix_caching_reports_nothing_cached(uncached_server: RunningServer) -> None:
    client, model, system = _client(uncached_server), uncached_server.model, _system()
    for question in ("What is a list?", "What is a list?"):
        assert _cached((await _chat(client, model, system, question)).usage) == 0
