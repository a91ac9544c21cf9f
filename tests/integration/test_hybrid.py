"""The hybrid proposer on the real engine: lookups in a request's own context and in its tenant's
earlier replies keep greedy output identical and the sampled distribution unchanged, are
verified with the draft idle in those steps, and never cross tenants."""

from collections.abc import AsyncIterator
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from server.engine.contract import GenerationRequest, SamplingOptions, SpeculationStats
from server.engine.vllm_engine import VllmEngine
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
from tests.integration.test_lossless import PROMPTS, TVD_BOUND, _at, _binned_total_variation

pytestmark = pytest.mark.integration

GREEDY = SamplingOptions(max_tokens=48, temperature=0.0)
DRAFT_COUNTS = ("draft_forward_passes", "draft_catch_up_passes", "draft_skipped_steps")


@pytest.fixture(scope="module")
async def hybrid_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """The partly-accepted draft at K=3 plus lookups of up to 8 tokens."""
    config = tiny_engine_config(
        tiny,
        tiny.close_draft,
        served_model_name="tiny-hybrid",
        speculative_method="hybrid",
        lookup_max_tokens=8,
        lookup_index_tokens=4096,
    )
    async for running in serve(config):
        yield running


async def _tokens(
    engine: VllmEngine, request_id: str, prompt: str, options: SamplingOptions, tenant: str | None
) -> list[list[int]]:
    request = GenerationRequest(request_id, engine.tokenize(prompt), options, tenant=tenant)
    tokens: dict[int, list[int]] = {}
    async for output in engine.generate(request):
        for delta in output.choices:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    return [tokens[i] for i in sorted(tokens)]


async def _counts(server: RunningServer) -> dict[str, Any]:
    """The scheduler's and the draft's cumulative counts, once the engine is idle."""
    await server.wait_engine_idle(60)
    feed = server.engine._feed
    assert feed is not None
    scheduler, draft = feed.scheduler(), feed.draft()
    none = {"verified": 0, "accepted": 0, "steps": 0}
    return {
        **dict.fromkeys(("draft", "lookup", "prompt", "replies"), none),
        **scheduler.get("verified_by_source", {}),
        **scheduler.get("lookup_by_origin", {}),
        "lookup_steps": scheduler.get("zero_steps_by_reason", {}).get("lookup", 0),
        "steps_by_k": {int(k): n for k, n in scheduler.get("steps_by_k", {}).items()},
        **{name: draft.get(name, 0) for name in DRAFT_COUNTS},
    }


def _grown(after: dict[str, Any], before: dict[str, Any], source: str, field: str) -> int:
    return int(after[source][field] - before[source][field])


async def test_greedy_output_is_identical_with_lookups(
    hybrid_server: RunningServer, plain_server: RunningServer
) -> None:
    before = await _counts(hybrid_server)
    for i, prompt in enumerate(PROMPTS):
        for attempt in range(2):  # the second time the tenant's first reply holds the answer
            (hybrid,) = await _tokens(
                hybrid_server.engine, f"greedy-hybrid-{i}-{attempt}", prompt, GREEDY, "t"
            )
            (plain,) = await _tokens(plain_server.engine, f"greedy-plain-{i}-{attempt}", prompt,
                                     GREEDY, None)  # fmt: skip
            assert hybrid == plain, prompt
    after = await _counts(hybrid_server)
    # Both sources proposed, and lookups were both accepted and rejected or the comparison
    # would not cover the verify path's both ends.
    for source in ("draft", "lookup"):
        assert _grown(after, before, source, "verified") > 0, source
    assert 0 < _grown(after, before, "lookup", "accepted") < _grown(
        after, before, "lookup", "verified"
    ) or _grown(after, before, "draft", "accepted") < _grown(after, before, "draft", "verified")


async def test_a_repeated_request_is_served_from_lookups_with_the_draft_idle(
    hybrid_server: RunningServer,
) -> None:
    prompt = "class Stack:\n    def push(self, item):"
    (first,) = await _tokens(hybrid_server.engine, "repeat-1", prompt, GREEDY, "repeat")
    before = await _counts(hybrid_server)
    (again,) = await _tokens(hybrid_server.engine, "repeat-2", prompt, GREEDY, "repeat")
    after = await _counts(hybrid_server)
    assert again == first
    assert _grown(after, before, "replies", "accepted") > 0
    lookup_steps = after["lookup_steps"] - before["lookup_steps"]
    assert lookup_steps > 0
    # The draft ran in no step that verified lookups only: its passes are those of the steps
    # that proposed (K each) and its catch-ups, and it skipped every K=0 step.
    k_steps = {k: n - before["steps_by_k"].get(k, 0) for k, n in after["steps_by_k"].items()}
    proposing = sum(k * n for k, n in k_steps.items())
    catch_ups = after["draft_catch_up_passes"] - before["draft_catch_up_passes"]
    passes = after["draft_forward_passes"] - before["draft_forward_passes"]
    assert passes == proposing + catch_ups
    skipped = after["draft_skipped_steps"] - before["draft_skipped_steps"]
    assert skipped == k_steps.get(0, 0) >= lookup_steps
    # Lookups of up to 8 tokens raised vLLM's K; the draft still proposed at most its own 3.
    assert max(k for k, n in k_steps.items() if n) <= 3, k_steps


async def test_a_biased_request_gets_no_lookups(
    hybrid_server: RunningServer, plain_server: RunningServer
) -> None:
    """vLLM verifies proposed tokens without the bias, so a lookup of the tenant's earlier reply
    reaching a request that bans one of its tokens would bring the banned token back."""
    prompt = "def fibonacci(n):"
    (reply,) = await _tokens(hybrid_server.engine, "bias-1", prompt, GREEDY, "bias")
    banned = next(t for i, t in enumerate(reply) if i >= 16 and t not in reply[:i])
    biased = replace(GREEDY, logit_bias=MappingProxyType({banned: -100.0}))
    before = await _counts(hybrid_server)
    (hybrid,) = await _tokens(hybrid_server.engine, "bias-2", prompt, biased, "bias")
    after = await _counts(hybrid_server)
    (plain,) = await _tokens(plain_server.engine, "bias-plain", prompt, biased, None)
    assert banned not in hybrid
    assert hybrid == plain
    assert _grown(after, before, "lookup", "verified") == 0


async def test_a_request_that_asks_for_the_draft_alone_gets_no_lookups(
    hybrid_server: RunningServer,
) -> None:
    prompt = "class Queue:\n    def put(self, item):"
    (first,) = await _tokens(hybrid_server.engine, "no-lookups-1", prompt, GREEDY, "no-lookups")
    before = await _counts(hybrid_server)
    draft_only = replace(GREEDY, lookups=False)
    (again,) = await _tokens(hybrid_server.engine, "no-lookups-2", prompt, draft_only, "no-lookups")
    after = await _counts(hybrid_server)
    assert again == first
    assert _grown(after, before, "lookup", "verified") == 0  # its own reply was there to find
    assert _grown(after, before, "draft", "verified") > 0


async def test_one_tenant_s_replies_are_never_proposed_to_another(
    hybrid_server: RunningServer,
) -> None:
    prompt = "import os\nimport sys\n\ndef main():"
    (reply,) = await _tokens(hybrid_server.engine, "tenant-a-1", prompt, GREEDY, "a")
    before = await _counts(hybrid_server)
    (other,) = await _tokens(hybrid_server.engine, "tenant-b-1", prompt, GREEDY, "b")
    middle = await _counts(hybrid_server)
    (again,) = await _tokens(hybrid_server.engine, "tenant-a-2", prompt, GREEDY, "a")
    after = await _counts(hybrid_server)
    assert reply == other == again
    assert _grown(middle, before, "replies", "verified") == 0  # b has no replies of its own
    assert _grown(after, middle, "replies", "accepted") > 0  # a's own reply is looked up


async def _speculation(
    engine: VllmEngine, request_id: str, prompt: str, options: SamplingOptions, stream: bool
) -> list[SpeculationStats]:
    """Each sequence's speculation counts, from its last output."""
    request = GenerationRequest(
        request_id, engine.tokenize(prompt), options, stream=stream, tenant="counts"
    )
    return [
        delta.speculation
        async for output in engine.generate(request)
        for delta in output.choices
        if delta.speculation is not None
    ]


@pytest.mark.parametrize(
    ("options", "stream"),
    [(GREEDY, True), (replace(GREEDY, n=2, temperature=1.0, seed=7), False)],
    ids=["streamed", "two-whole-sequences"],
)
async def test_each_sequence_s_counts_by_source_add_up_to_the_scheduler_s(
    hybrid_server: RunningServer, options: SamplingOptions, stream: bool
) -> None:
    """The scheduler counts a sequence's lookups and hands them over with its last output
    (vLLM's kv_transfer_params); what the draft verified is the rest of vLLM's own counts."""
    engine, prompt = hybrid_server.engine, "def add(a, b):\n    return a + b\n\n\ndef"
    await _tokens(engine, f"counts-prime-{stream}", prompt, GREEDY, "counts")
    before = await _counts(hybrid_server)
    stats = await _speculation(engine, f"counts-{stream}", prompt, options, stream)
    after = await _counts(hybrid_server)
    assert len(stats) == options.n
    looked_up = sum(s.lookup_tokens for s in stats)
    assert looked_up == _grown(after, before, "lookup", "verified") > 0
    assert sum(s.lookup_accepted_tokens for s in stats) == _grown(
        after, before, "lookup", "accepted"
    )
    drafted = sum(s.draft_tokens for s in stats) - looked_up
    assert drafted == _grown(after, before, "draft", "verified")
    assert sum(s.accepted_tokens - s.lookup_accepted_tokens for s in stats) == _grown(
        after, before, "draft", "accepted"
    )


@pytest.fixture(scope="module")
async def lookup_only_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """Hybrid with the draft held idle (K=0 every step): lookups are the only proposals. With
    no draft step its cost model never fits, so no lookup is priced out."""
    config = tiny_engine_config(
        tiny,
        tiny.close_draft,
        served_model_name="tiny-lookup",
        speculative_method="hybrid",
        speculation_script="0",
        lookup_max_tokens=8,
        lookup_index_tokens=4096,
    )
    async for running in serve(config):
        yield running


SAMPLED_TOKENS = 8
LOOKUP_SAMPLES = 2000


async def test_sampled_distribution_is_unchanged_by_lookups(
    lookup_only_server: RunningServer, plain_server: RunningServer
) -> None:
    """The tenant's index holds the target's greedy reply: whenever a sample starts the same
    way, lookups propose the target's most likely tokens, which a lookup accepted without the
    rejection test would over-represent."""
    engine, prompt = lookup_only_server.engine, "The quick brown fox"
    greedy = SamplingOptions(max_tokens=2 * SAMPLED_TOKENS, temperature=0.0)
    await _tokens(engine, "prime", prompt, greedy, "s")
    before = await _counts(lookup_only_server)
    one = SamplingOptions(max_tokens=SAMPLED_TOKENS, temperature=1.0)
    with_lookups = [
        (await _tokens(engine, f"dist-lookup-{i}", prompt, one, "s"))[0]
        for i in range(LOOKUP_SAMPLES)
    ]
    after = await _counts(lookup_only_server)
    fifty = SamplingOptions(max_tokens=SAMPLED_TOKENS, temperature=1.0, n=50)
    without = [
        sequence
        for i in range(LOOKUP_SAMPLES // 50)
        for sequence in await _tokens(plain_server.engine, f"dist-plain-{i}", prompt, fifty, None)
    ]
    assert len(with_lookups) == len(without) == LOOKUP_SAMPLES
    verified = _grown(after, before, "replies", "verified")
    assert 0 < _grown(after, before, "replies", "accepted") < verified
    for position in range(1, SAMPLED_TOKENS):
        distance = _binned_total_variation(_at(with_lookups, position), _at(without, position))
        assert distance < TVD_BOUND, f"token {position + 1}: total variation {distance:.3f}"
