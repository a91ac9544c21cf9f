"""A seeded request repeats whatever K its steps run at (server/vllm_plugins/seeded_sampling.py).

Three engines on the same partly-accepted draft force different K sequences
(cycled per engine step): 0,3,0,1,2; always 4; always 0. A seeded sampled
request gives the same tokens on all of them, with neighbours in its steps
or without, and the same as the engine without speculation. Across many
seeds, the tokens are still distributed as without speculation.
"""

import asyncio
from collections.abc import AsyncIterator

import pytest

from server.engine.contract import SamplingOptions
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
from tests.integration.test_lossless import (
    PROMPTS,
    SAMPLE_TOKENS,
    SAMPLES,
    TVD_BOUND,
    _at,
    _binned_total_variation,
    _run,
    _sample,
)

pytestmark = pytest.mark.integration

SCRIPTS = {"switching": "0,3,0,1,2", "always-4": "4", "always-0": "0"}
TOKENS = 32
SEEDED = [
    SamplingOptions(max_tokens=TOKENS, temperature=1.0, seed=1234),
    SamplingOptions(max_tokens=TOKENS, temperature=0.7, seed=7),
    SamplingOptions(max_tokens=TOKENS, temperature=1.0, top_p=0.9, seed=99),
    SamplingOptions(max_tokens=TOKENS, temperature=1.0, presence_penalty=0.5, seed=5),
    SamplingOptions(max_tokens=TOKENS, temperature=1.0, n=3, seed=42),
]


@pytest.fixture(scope="module")
async def scripted(tiny: TinyModels) -> AsyncIterator[dict[str, RunningServer]]:
    """One engine per K script, each on the close draft with up to 4 drafts per step."""
    servers: dict[str, RunningServer] = {}
    runs = []
    for name, script in SCRIPTS.items():
        config = tiny_engine_config(
            tiny,
            tiny.close_draft,
            served_model_name=f"tiny-seeded-{name}",
            num_speculative_tokens=4,
            speculation_script=script,
        )
        run = serve(config)
        servers[name] = await run.__anext__()
        runs.append(run)
    yield servers
    for run in runs:
        await run.aclose()


async def test_a_seeded_request_gives_the_same_text_whatever_k(
    scripted: dict[str, RunningServer], plain_server: RunningServer
) -> None:
    verified = accepted = 0
    for i, options in enumerate(SEEDED):
        prompt = PROMPTS[i % len(PROMPTS)]
        (reference, _) = await _run(plain_server.engine, f"seeded-plain-{i}", prompt, options)
        assert len(reference) == options.n
        for name, server in scripted.items():
            choices, stats = await _run(server.engine, f"seeded-{name}-{i}", prompt, options)
            assert choices == reference, f"{name}: {options}"
            verified += sum(s.draft_tokens for s in stats)
            accepted += sum(s.accepted_tokens for s in stats)
        if options.n > 1:
            assert len({tuple(choice) for choice in reference}) == options.n, "one stream each"
    # Speculation stayed on for seeded requests: drafts were both accepted and rejected.
    assert 0 < accepted < verified


async def test_neighbours_do_not_change_a_seeded_request(
    scripted: dict[str, RunningServer],
) -> None:
    server = scripted["switching"]
    options = SamplingOptions(max_tokens=TOKENS, temperature=1.0, seed=2024)
    alone, _ = await _run(server.engine, "alone", PROMPTS[0], options)
    neighbour = SamplingOptions(max_tokens=TOKENS, temperature=1.0)
    busy, *_ = await asyncio.gather(
        _run(server.engine, "busy", PROMPTS[0], options),
        *(_run(server.engine, f"neighbour-{i}", PROMPTS[i], neighbour) for i in range(1, 4)),
    )
    assert busy[0] == alone


async def test_unseeded_requests_still_vary(scripted: dict[str, RunningServer]) -> None:
    server = scripted["always-4"]
    options = SamplingOptions(max_tokens=TOKENS, temperature=1.0)
    runs = [await _run(server.engine, f"unseeded-{i}", PROMPTS[1], options) for i in range(3)]
    assert len({tuple(choices[0]) for choices, _ in runs}) > 1


async def test_seeded_tokens_are_distributed_as_without_speculation(
    scripted: dict[str, RunningServer], plain_server: RunningServer
) -> None:
    """Each request seeded by its index (its n=50 choices by seed + choice): 3,000 seeds."""
    server = scripted["switching"]
    options = [
        SamplingOptions(max_tokens=SAMPLE_TOKENS, temperature=1.0, n=50, seed=50 * i)
        for i in range(SAMPLES // 50)
    ]
    runs = await asyncio.gather(
        *(
            _run(server.engine, f"seeds-{i}", "The quick brown fox", option)
            for i, option in enumerate(options)
        )
    )
    seeded = [choice for choices, _ in runs for choice in choices]
    drafts = sum(s.drafts for _, stats in runs for s in stats)
    unseeded, _ = await _sample(plain_server.engine, "seeds-plain")
    assert len(seeded) == len(unseeded) == SAMPLES
    assert drafts > 0, "the sampled tokens must have gone through speculation"
    for position in range(1, SAMPLE_TOKENS):
        distance = _binned_total_variation(_at(seeded, position), _at(unseeded, position))
        assert distance < TVD_BOUND, f"token {position + 1}: total variation {distance:.3f}"
