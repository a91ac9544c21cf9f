"""Prompt caching as clients and metrics see it, over the scripted engine (its cached tokens
are a prompt's longest common prefix with an earlier one of the same tenant), and the settings
that shape the engine's cache: block size, prefix caching on or off, a cache salt per tenant.
The real engine's counts are checked in tests/integration/test_prompt_cache.py."""

from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from server import cli
from server.config import DEFAULT_CPU_BLOCK_SIZE, ConfigError, Settings
from server.engine import resolve as resolve_module
from server.engine.contract import GenerationRequest, SamplingOptions
from server.engine.resolve import resolve
from server.engine.vllm_engine import EngineConfig, VllmEngine
from tests.unit.sse import events

SHARED = "one two three four five six seven eight"


def _sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _chat(client: httpx.AsyncClient, question: str, **extra: object) -> httpx.Response:
    return await client.post(
        "/v1/chat/completions",
        json={
            "model": "scripted",
            "messages": [{"role": "user", "content": f"{SHARED} {question}"}],
            "max_tokens": 2,
            **extra,
        },
    )


async def test_chat_usage_reports_the_cached_prefix_the_second_time(
    client: httpx.AsyncClient,
) -> None:
    first = (await _chat(client, "nine")).json()["usage"]
    second = (await _chat(client, "ten")).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # "user:" and the eight shared words; "ten" differs from "nine".
    assert second["prompt_tokens_details"] == {"cached_tokens": 9}
    assert second["prompt_tokens"] == 10


async def test_streamed_usage_chunk_carries_cached_tokens(client: httpx.AsyncClient) -> None:
    await _chat(client, "nine")
    response = await _chat(client, "ten", stream=True, stream_options={"include_usage": True})
    usage = [e for e in events(response.text) if isinstance(e, dict) and e.get("usage")][-1][
        "usage"
    ]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 9}


async def test_completions_and_responses_report_cached_tokens(client: httpx.AsyncClient) -> None:
    body = {"model": "scripted", "prompt": f"{SHARED} nine", "max_tokens": 2}
    await client.post("/v1/completions", json=body)
    again = (await client.post("/v1/completions", json=body)).json()["usage"]
    # The whole prompt is shared: all but its last token, which is computed to sample from.
    assert again["prompt_tokens_details"] == {"cached_tokens": 8}
    body = {"model": "scripted", "input": f"{SHARED} nine", "max_output_tokens": 2}
    first = (await client.post("/v1/responses", json=body)).json()["usage"]
    again = (await client.post("/v1/responses", json=body)).json()["usage"]
    assert first["input_tokens_details"]["cached_tokens"] == 0
    assert again["input_tokens_details"]["cached_tokens"] == again["input_tokens"] - 1


def _first_tokens_timed() -> tuple[float, float]:
    """Requests whose first token was timed on chat: (cache hits, cache misses)."""
    name = "specserve_time_to_first_token_by_prompt_cache_seconds_count"
    labels = {"model": "scripted", "endpoint": "/v1/chat/completions"}
    return (
        _sample(name, {**labels, "prompt_cache": "hit"}),
        _sample(name, {**labels, "prompt_cache": "miss"}),
    )


async def test_cached_tokens_and_ttft_by_cache_reach_the_metrics(
    client: httpx.AsyncClient,
) -> None:
    tokens = {"model": "scripted", "endpoint": "/v1/chat/completions", "tenant": "anonymous"}
    cached_before = _sample("specserve_prompt_cached_tokens_total", tokens)
    hits_before, misses_before = _first_tokens_timed()
    await _chat(client, "nine")
    await _chat(client, "ten")
    assert _sample("specserve_prompt_cached_tokens_total", tokens) - cached_before == 9
    hits, misses = _first_tokens_timed()
    assert (hits - hits_before, misses - misses_before) == (1, 1)


def _resolved(monkeypatch: pytest.MonkeyPatch, on_gpu: bool, **values: Any) -> EngineConfig:
    monkeypatch.setattr(resolve_module, "has_gpu", lambda: on_gpu)
    monkeypatch.setattr(resolve_module, "gpu_count", lambda: int(on_gpu))
    return resolve(
        Settings(model="org/model", speculative_method="ngram", quantization="none", **values)
    )


def test_block_size_default_on_cpu_vllms_on_gpu_and_the_users_anywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _resolved(monkeypatch, on_gpu=False).block_size == DEFAULT_CPU_BLOCK_SIZE
    assert _resolved(monkeypatch, on_gpu=True).block_size is None
    assert _resolved(monkeypatch, on_gpu=False, block_size=32).block_size == 32
    assert _resolved(monkeypatch, on_gpu=False).prefix_caching
    assert not _resolved(monkeypatch, on_gpu=False, no_prefix_caching=True).prefix_caching


@pytest.mark.parametrize("block_size", [8, 24])
def test_block_sizes_that_are_no_multiple_of_16_are_refused(block_size: int) -> None:
    with pytest.raises(ValidationError, match="block_size"):
        Settings(block_size=block_size)


def test_a_cpu_refuses_block_sizes_its_attention_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"--block-size 48: .* multiple of 32"):
        _resolved(monkeypatch, on_gpu=False, block_size=48)
    assert _resolved(monkeypatch, on_gpu=True, block_size=48).block_size == 48


@pytest.mark.parametrize(
    ("shared", "tenant", "salt"),
    [(False, "team-a", "team-a"), (False, None, None), (True, "team-a", None)],
)
def test_each_tenant_salts_its_own_prompts_unless_the_cache_is_shared(
    shared: bool, tenant: str | None, salt: str | None
) -> None:
    config = EngineConfig(
        model="m",
        served_model_name="m",
        draft_model=None,
        speculative_method=None,
        num_speculative_tokens=0,
        speculation_max_batch_size=1,
        max_model_len=None,
        dtype="float32",
        seed=0,
        kv_cache_gib=None,
        max_num_seqs=1,
        shared_prefix_cache=shared,
    )
    request = GenerationRequest("r", [1, 2], SamplingOptions(max_tokens=1), tenant=tenant)
    assert VllmEngine(config)._cache_salt(request) == salt


def test_serve_takes_the_prompt_cache_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(resolve_module, "has_gpu", lambda: False)
    flags = ["--no-prefix-caching", "--shared-prefix-cache", "--block-size", "48"]
    assert cli.main(["serve", *flags]) == 2
    assert "--block-size 48: vLLM's CPU attention needs a multiple of 32" in capsys.readouterr().err
