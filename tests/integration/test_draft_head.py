"""The trimmed draft head (server/vllm_plugins/draft_head.py) on the real engine: the target's
greedy output is unchanged with a ranked half of the draft's vocabulary (acceptance on
the real pair: docs/benchmarks.md), and with almost nothing kept the draft proposes from
each request's own ids."""

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.engine.contract import SamplingOptions
from server.engine.vllm_engine import VllmEngine
from server.weights import draft_vocab
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
from tests.integration.test_lossless import PROMPTS, _run
from tests.tiny_models import tokenizer_vocab_size

pytestmark = pytest.mark.integration


async def _head_report(engine: VllmEngine, proposals: int) -> dict[str, Any]:
    """The draft head's report once it counts at least `proposals`."""
    while True:
        state = engine.autopilot_state() or {}
        if state.get("draft_head_proposals", 0) >= proposals:
            return state
        await asyncio.sleep(0.05)


async def _compare(
    server: RunningServer, plain: RunningServer, name: str, max_tokens: int = 32
) -> tuple[int, int]:
    """Greedy replies equal to the plain server's; (drafted, accepted) tokens."""
    greedy = SamplingOptions(max_tokens=max_tokens, temperature=0.0)
    drafted = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        (tokens,), stats = await _run(server.engine, f"{name}-{i}", prompt, greedy)
        (reference,), _ = await _run(plain.engine, f"{name}-plain-{i}", prompt, greedy)
        assert tokens == reference, prompt
        drafted += sum(s.draft_tokens for s in stats)
        accepted += sum(s.accepted_tokens for s in stats)
    return drafted, accepted


async def test_a_ranked_half_head_keeps_greedy_output(
    tiny: TinyModels, plain_server: RunningServer, tmp_path: Path
) -> None:
    ranking = draft_vocab.ranking(tiny.close_draft, tmp_path, report=print)
    size = tokenizer_vocab_size(tiny.close_draft) // 2
    config = tiny_engine_config(
        tiny,
        tiny.close_draft,
        served_model_name="tiny-trimmed",
        draft_vocab_ranking=ranking,
        draft_vocab_size=size,
    )
    async for server in serve(config):
        drafted, accepted = await _compare(server, plain_server, "half")
        report = await _head_report(server.engine, 1)
    assert report["draft_head"].startswith(f"trimmed: {size} ids kept"), report
    # Random weights use their ids about evenly, so half a head loses part of the
    # acceptance here; what the ranking keeps on a real pair is measured in
    # docs/benchmarks.md.
    assert 0 < accepted < drafted, (accepted, drafted)


async def test_with_only_the_specials_kept_it_proposes_each_requests_own_ids(
    tiny: TinyModels, plain_server: RunningServer, tmp_path: Path
) -> None:
    # A ranking whose first ids are the specials: a head of just those proposes
    # only through each request's own prompt and reply ids.
    order = draft_vocab.build_order(tiny.close_draft, iter(()))
    ranking = tmp_path / "specials-first.npy"
    np.save(ranking, np.array(order))
    config = tiny_engine_config(
        tiny,
        tiny.close_draft,
        served_model_name="tiny-specials-head",
        draft_vocab_ranking=ranking,
        draft_vocab_size=4,
    )
    async for server in serve(config):
        drafted, accepted = await _compare(server, plain_server, "specials")
        report = await _head_report(server.engine, 1)
    assert report["draft_head_own_proposals"] > 0, report
    # The target's reply repeats its own and its prompt's ids: some are accepted.
    assert 0 < accepted < drafted, (accepted, drafted)
