"""The speculation autopilot on the real engine: K switching per step stays
lossless, the draft does not run at K=0 and catches up after, and auto mode
calibrates, decides, reports and traces its steps.

A forced K sequence ("script", cycled per engine step) drives the switching:
0 for 4 steps, 3 for 4, 0 for 4, 1 for 4, 2 for 4.
"""

import json
from collections import Counter
from collections.abc import AsyncIterator
from itertools import takewhile
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from server.engine.contract import SamplingOptions
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
from tests.integration.test_lossless import PROMPTS, _at, _binned_total_variation, _run, _sample

pytestmark = pytest.mark.integration

SCRIPT = "0x4,3x4,0x4,1x4,2x4"
GREEDY_TOKENS = 48


@pytest.fixture(scope="module")
async def scripted_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """A partly-accepted draft with K forced through the script."""
    config = tiny_engine_config(
        tiny, tiny.close_draft, served_model_name="tiny-scripted", speculation_script=SCRIPT
    )
    async for running in serve(config):
        yield running


@pytest.fixture(scope="module")
async def scripted_self_draft(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """The target drafting for itself (everything accepted) through the script."""
    config = tiny_engine_config(
        tiny, tiny.target, served_model_name="tiny-self-scripted", speculation_script=SCRIPT
    )
    async for running in serve(config):
        yield running


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "steps.jsonl"


@pytest.fixture(scope="module")
async def auto_server(tiny: TinyModels, trace_file: Path) -> AsyncIterator[RunningServer]:
    config = tiny_engine_config(
        tiny,
        tiny.close_draft,
        served_model_name="tiny-auto",
        speculation_mode="auto",
        speculation_trace=trace_file,
    )
    async for running in serve(config):
        yield running


def _reports(server: RunningServer) -> tuple[dict, dict]:
    feed = server.engine._feed
    assert feed is not None, "the autopilot is not running"
    return feed.scheduler(), feed.draft()


async def test_greedy_output_is_identical_while_k_switches(
    scripted_server: RunningServer, plain_server: RunningServer
) -> None:
    options = SamplingOptions(max_tokens=GREEDY_TOKENS, temperature=0.0)
    steps: dict[int, int] = {}
    drafted = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        (switched,), stats = await _run(scripted_server.engine, f"switch-{i}", prompt, options)
        (plain,), _ = await _run(plain_server.engine, f"switch-plain-{i}", prompt, options)
        assert switched == plain, prompt
        for s in stats:
            drafted += s.draft_tokens
            accepted += s.accepted_tokens
            for k, n in s.steps_by_k.items():
                steps[k] = steps.get(k, 0) + n
    # Every K of the script verified drafts, some steps idled the draft, and
    # drafts were both accepted and rejected: the comparison means something.
    assert {0, 1, 2, 3} <= set(steps), steps
    assert 0 < accepted < drafted


async def test_the_draft_never_runs_at_k_zero(scripted_server: RunningServer) -> None:
    options = SamplingOptions(max_tokens=GREEDY_TOKENS, temperature=0.0)
    await _run(scripted_server.engine, "passes", PROMPTS[0], options)
    await scripted_server.wait_engine_idle(60)
    scheduler, draft = _reports(scripted_server)
    steps_by_k = {int(k): n for k, n in scheduler["steps_by_k"].items()}
    # Each K>0 step runs K draft passes, each catch-up one more; a K=0 step none.
    proposing = sum(k * n for k, n in steps_by_k.items())
    assert draft["draft_forward_passes"] == proposing + draft["draft_catch_up_passes"]
    assert draft["draft_skipped_steps"] == steps_by_k[0] > 0
    assert draft["draft_catch_up_passes"] > 0
    assert draft["draft_caught_up_tokens"] >= draft["draft_catch_up_passes"]


async def test_acceptance_after_a_pause_is_as_without_one(
    scripted_self_draft: RunningServer,
) -> None:
    """A self-draft accepts every token when its KV cache is complete; a draft
    that missed the paused positions would reject some after each pause."""
    options = SamplingOptions(max_tokens=GREEDY_TOKENS, temperature=0.0)
    for i, prompt in enumerate(PROMPTS[:3]):
        _, stats = await _run(scripted_self_draft.engine, f"pause-{i}", prompt, options)
        (s,) = stats
        assert s.steps_by_k.get(0, 0) > 0 and s.drafts > 0, s
        assert s.accepted_tokens == s.draft_tokens, s


async def test_sampled_distribution_is_unchanged_while_k_switches(
    scripted_server: RunningServer, plain_server: RunningServer
) -> None:
    with_spec, drafts = await _sample(scripted_server.engine, "dist-switch")
    without, _ = await _sample(plain_server.engine, "dist-switch-plain")
    assert drafts > 0
    for position in range(1, 4):
        distance = _binned_total_variation(_at(with_spec, position), _at(without, position))
        assert distance < 0.1, f"token {position + 1}: total variation {distance:.3f}"


async def test_auto_mode_calibrates_decides_and_reports(auto_server: RunningServer) -> None:
    scheduler, _ = _reports(auto_server)
    assert scheduler["cost_ready"], scheduler
    async with httpx.AsyncClient(base_url=auto_server.base_url, timeout=120) as http:
        response = await http.post(
            "/v1/completions",
            json={"model": "tiny-auto", "prompt": "def add(a, b):", "max_tokens": 32},
        )
        assert response.status_code == 200
        summary = response.json()["speculation"]
        assert summary["mode"] == "auto"
        steps = sum(summary["steps_by_k"].values())
        assert steps > 0, summary
        if not summary["applied"]:
            assert summary["reason"] in {"not_paying", "batch_too_large", "too_short"}
        text = (await http.get("/metrics")).text
        details = (await http.get("/health")).json()["details"]
    state = details["autopilot"]
    assert state["mode"] == "auto" and state["cost_ready"], state
    # vLLM's resolved config: the V1 runner and the synchronous scheduling the patches need.
    engine = details["engine"]
    assert (engine["speculation"], engine["runner"], engine["async_scheduling"]) == (
        "specserve",
        "v1",
        False,
    )
    assert engine["compiled"] is True  # torch.compile unless --enforce-eager
    assert {"autopilot", "draft_idle", "seeded_sampling"} <= set(engine["patches"]), engine
    assert state["draft_seconds_per_token"] >= 0 and state["verify_seconds_per_token"] >= 0
    assert state["plain_step_seconds"] > 0
    assert len(state["acceptance_by_position"]) == 3
    labels = {"model": "tiny-auto"}
    assert REGISTRY.get_sample_value("specserve_speculation_k_in_force", labels) is not None
    assert REGISTRY.get_sample_value("specserve_speculation_predicted_speedup", labels) > 0
    assert "specserve_speculation_steps_total{" in text


async def test_auto_mode_traces_every_step(auto_server: RunningServer, trace_file: Path) -> None:
    async with httpx.AsyncClient(base_url=auto_server.base_url, timeout=120) as http:
        response = await http.post(
            "/v1/completions",
            json={"model": "tiny-auto", "prompt": "def sub(a, b):", "max_tokens": 16},
        )
        assert response.status_code == 200
    scheduler, _ = _reports(auto_server)
    steps = [json.loads(line) for line in trace_file.read_text().splitlines()]
    # One line per step the engine ran, calibration included, with the K it ran.
    assert Counter(str(step["k"]) for step in steps) == Counter(scheduler["steps_by_k"])
    # Calibration starts with the lone request: every K held two steps, two cycles over
    # (tokens enough for two even if every draft is accepted), so each shape has two samples
    # before four requests run together.
    lone = list(takewhile(lambda step: step["batch"] == 1, steps))
    k_max = len(steps[-1]["predicted_seconds_by_k"]) - 1
    assert sum(step["generated"] for step in lone) >= 2 * (k_max + 1) * (k_max + 2), lone
    steps_by_k = Counter(step["k"] for step in lone)
    assert all(steps_by_k[k] >= 4 for k in range(k_max + 1)), steps_by_k
    # A step idled for "prefill" is one of prompts only (after steps of more requests).
    prefill = [s for s in steps if s["reason"] == "prefill"]
    assert all(s["prefill_tokens"] > 0 and s["k"] == 0 for s in prefill), prefill
    assert any(s["prefill_tokens"] > 0 for s in steps)
    last = steps[-1]
    assert last["seconds"] > 0 and last["batch"] == 1 and last["generated"] >= 1, last
    assert len(last["predicted_seconds_by_k"]) == 4 and len(last["acceptance_by_position"]) == 3


async def test_a_request_caps_its_own_drafts(scripted_self_draft: RunningServer) -> None:
    async def complete(http: httpx.AsyncClient, extra: dict) -> dict:
        body = {"model": "tiny-self-scripted", "prompt": PROMPTS[1], "max_tokens": 40}
        response = await http.post("/v1/completions", json={**body, "temperature": 0, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    async with httpx.AsyncClient(base_url=scripted_self_draft.base_url, timeout=120) as http:
        free = await complete(http, {})
        one = await complete(http, {"speculation": {"max_draft_tokens": 1}})
        off = await complete(http, {"speculation": {"max_draft_tokens": 0}})
    # The script asks for up to 3 drafts; capped at 1, every verify step checks one.
    assert free["speculation"]["draft_tokens"] > free["speculation"]["drafts"] > 0
    assert one["speculation"]["draft_tokens"] == one["speculation"]["drafts"] > 0
    assert off["speculation"]["drafts"] == 0
    assert set(off["speculation"]["steps_by_k"]) == {"0"}
    scheduler, _ = _reports(scripted_self_draft)
    assert scheduler["zero_steps_by_reason"]["requested_off"] > 0
    texts = {reply["choices"][0]["text"] for reply in (free, one, off)}
    assert len(texts) == 1
