"""The vLLM patch layer on the real engine: a patch that fails inside a worker hands its
path back to vLLM and the engine keeps serving; where vLLM would pick its V2 model runner,
the engine pins V1 so the patches reach it."""

import logging
import os

import pytest
from prometheus_client import REGISTRY

from server.engine.contract import SamplingOptions
from server.vllm_plugins import patching, registry
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
from tests.integration.test_lossless import PROMPTS, _run

pytestmark = pytest.mark.integration

GREEDY = SamplingOptions(max_tokens=24, temperature=0.0)


async def test_a_failed_catch_up_leaves_the_draft_to_vllm_and_the_engine_serving(
    tiny: TinyModels,
    plain_server: RunningServer,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The prompt's first step runs at K=0, so the next one catches the draft up: the fault.
    monkeypatch.setenv(patching.FAULT_ENV, "draft_catch_up")
    config = tiny_engine_config(
        tiny, tiny.close_draft, served_model_name="tiny-fault", speculation_script="0x2,3x3"
    )
    async for server in serve(config):
        drafted = 0
        for i, prompt in enumerate(PROMPTS[:3]):
            (tokens,), stats = await _run(server.engine, f"fault-{i}", prompt, GREEDY)
            (reference,), _ = await _run(plain_server.engine, f"fault-plain-{i}", prompt, GREEDY)
            assert tokens == reference, prompt
            drafted += sum(s.draft_tokens for s in stats)
        assert drafted > 0, "speculation went on, on vLLM's own draft path"
        feed = server.engine._feed
        assert feed is not None
        feed.drain()
        labels = {"model": "tiny-fault", "patch": "draft_idle"}
        assert REGISTRY.get_sample_value("specserve_vllm_patch_failures_total", labels) == 1
    log = capfd.readouterr().err
    assert log.count("the draft_idle patch failed; vLLM's own code from now on") == 1
    assert "injected fault at draft_catch_up" in log


class _OnGpu:
    """vLLM 0.33's choice on a GPU with Triton: V2 unless its variable says 0 (on this CPU
    vLLM refuses V2 outright, having no Triton backend)."""

    @property
    def use_v2_model_runner(self) -> bool:
        return os.environ.get(registry.RUNNER_VARIABLE) != "0"


async def test_where_vllm_would_run_its_v2_runner_the_engine_pins_v1(
    tiny: TinyModels, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine asks the runner question of vLLM's config as a GPU build would answer it;
    the engine processes get the 0 and the V1-runner patches reach their runner."""
    monkeypatch.delenv(registry.RUNNER_VARIABLE, raising=False)
    fit = registry.fit_model_runner
    monkeypatch.setattr(
        registry, "fit_model_runner", lambda config, patches: fit(_OnGpu(), patches)
    )
    config = tiny_engine_config(
        tiny, tiny.close_draft, served_model_name="tiny-v1-pinned", speculation_script="0x2,3x3"
    )
    with caplog.at_level(logging.WARNING):
        async for server in serve(config):
            assert os.environ[registry.RUNNER_VARIABLE] == "0"
            _, stats = await _run(server.engine, "pinned", PROMPTS[0], GREEDY)
            assert sum(s.draft_tokens for s in stats) > 0
            feed = server.engine._feed
            assert feed is not None
            await server.wait_engine_idle(60)
            # The draft_idle patch reached the runner: the draft skipped the K=0 steps.
            assert feed.draft()["draft_skipped_steps"] > 0
    assert "specserve: vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)" in caplog.text
