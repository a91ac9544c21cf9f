"""The vLLM adapter: the engine contract (`engine/contract.py`) on an in-process `AsyncLLM` (v1),
in the API process.

Builds it with draft-model or n-gram speculation, a per-batch-size speculation schedule,
per-request speculation metrics and the vLLM patches that can apply, sets up the CPU runtime
when there is no GPU (runtime.py), calibrates the autopilot (calibration.py), and streams
generations, with requests and outputs mapped by vllm_outputs.py.
"""

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from server.autopilot.idle import IdleReason
from server.config import DEFAULT_MAX_GRAMMAR_SYMBOLS, DRAFT_METHODS
from server.engine import grammar
from server.engine.autopilot_feed import AutopilotFeed
from server.engine.calibration import calibrate
from server.engine.compat import kv_cache_gib_for
from server.engine.contract import (
    EngineInfo,
    EngineMode,
    EngineOutput,
    GenerationRequest,
    SamplingOptions,
    SpeculationInfo,
    SpeculationStats,
    ToolCallParser,
)
from server.engine.hardware import choose_dtype
from server.engine.memory import (
    MemoryReport,
    lookup_trees_bound,
    release_free_heap,
    server_processes,
    weights_as_served,
)
from server.engine.runtime import configure_cpu_runtime, has_gpu, vllm_distribution
from server.engine.tool_calls import VllmToolCallParser, parser_class
from server.engine.vllm_outputs import (
    FinishedLookups,
    choice,
    sampling_params,
    speculation_stats,
    token_times,
)
from server.errors import EngineUnavailableError, InternalError, InvalidRequestError
from server.vllm_plugins import autopilot_patch, patching, registry, vllm_source

logger = logging.getLogger(__name__)

# Step reasons that only a request's own parameters cause: a step idles for them only when
# every request in it asked for no drafts or carried logit_bias, so a request without either
# never ran in one, and the server's counts of them would name a neighbour's parameters.
NEIGHBOURS_OWN = (IdleReason.LOGIT_BIAS, IdleReason.REQUESTED_OFF)

# Fill-in-the-middle tokens (prefix, suffix, middle) as code models spell them; a target
# whose tokenizer has one of these sets serves `suffix` on /v1/completions.
FILL_IN_THE_MIDDLE_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
)


@dataclass(frozen=True)
class EngineConfig:
    """Resolved engine settings: model locations are final (paths or hub ids)."""

    model: str
    served_model_name: str
    draft_model: str | None
    speculative_method: str | None  # None: no speculation
    num_speculative_tokens: int  # K in fixed mode, the largest K in auto mode
    speculation_max_batch_size: int  # fixed mode's cut-off
    max_model_len: int | None
    dtype: Literal["bfloat16", "float32", "auto"]  # auto: chosen for the hardware at start
    seed: int
    kv_cache_gib: int | None  # CPU only; None: sized for the dtype at start
    max_num_seqs: int
    tensor_parallel_size: int = 1  # ranks each layer is split across
    pipeline_parallel_size: int = 1  # stages the layers are split across
    distributed_executor_backend: Literal["mp", "ray"] = "mp"
    tool_call_parser: str = "hermes"  # vLLM's name of the parser for the target's calls
    speculation_mode: Literal["auto", "fixed"] = "auto"
    # vLLM's weight-loading progress bars: for a terminal, not for a log pipeline.
    progress_bars: bool = True
    speculation_trace: Path | None = None  # one JSON line per engine step here
    # Tests only: K forced per engine step ("0x4,3x4,1": K for so many steps, cycled).
    speculation_script: str | None = None
    quantization: str | None = None  # what vLLM quantizes the target to itself (fp8)
    int8_head: bool = False  # the int8 target's output head in int8 too (CPU, cpu_memory.py)
    draft_quantization: str | None = None  # what vLLM quantizes the draft to itself (fp8)
    # The trimmed draft head (draft_head.py): the ranking file and how many ids it keeps.
    draft_vocab_ranking: Path | None = None
    draft_vocab_size: int | None = None
    # Hybrid (speculative_method "hybrid"): the most looked-up tokens verified per step, and the
    # tokens of recent replies kept for lookups.
    lookup_max_tokens: int = 0
    lookup_index_tokens: int = 0
    block_size: int | None = None  # tokens per KV cache block; None: vLLM's default
    prefix_caching: bool = True
    enforce_eager: bool = False  # no torch.compile (nor CUDA graphs on a GPU)
    # False: each tenant's requests reuse only that tenant's cached prefixes (a cache salt each).
    shared_prefix_cache: bool = False
    # specserve's patches inside vLLM's engine: always on CPUs; on GPUs only when asked.
    engine_patches: bool = True
    # The largest grammar a request's JSON schema may compile to (grammar.py).
    max_grammar_symbols: int = DEFAULT_MAX_GRAMMAR_SYMBOLS


def speculation_schedule(k: int, max_batch_size: int, max_num_seqs: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: K up to the cut-off, 0 above."""
    if max_batch_size >= max_num_seqs:
        return [[1, max_num_seqs, k]]
    return [[1, max_batch_size, k], [max_batch_size + 1, max_num_seqs, 0]]


def kv_models(config: EngineConfig) -> list[str]:
    """The models whose layers share the KV cache: the target, then the draft."""
    if config.speculative_method in DRAFT_METHODS and config.draft_model is not None:
        return [config.model, config.draft_model]
    return [config.model]


class VllmEngine:
    """`Engine` backed by vLLM's AsyncLLM."""

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._llm: Any = None
        self._tokenizer: Any = None
        # Held by the threads that prepare requests (asyncio's executor, up to 32) while they
        # use the tokenizer. vLLM's tokenizer gives each thread using it at once a Rust
        # tokenizer of its own from a pool, copying one when none is free and keeping it (0.04
        # GB each for the embedded pair's), so threads that took it together would grow the
        # API process for good; tokenizing mostly holds the GIL, so taking turns costs little.
        self._tokenizing = threading.Lock()
        self._info: EngineInfo | None = None
        self._feed: AutopilotFeed | None = None
        self._tool_parser_class: Any = None
        self._patches: list[str] = []
        # On a CPU: each model's weights as served and the KV cache, in bytes (memory.py).
        self._planned: tuple[dict[str, int], int, int] | None = None
        # Why the features that need an engine patch are off, for their refusals.
        self._patches_off = "specserve's engine patches are off (see the startup log)"

    async def start(self) -> None:
        import cloudpickle
        from vllm import envs as vllm_envs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        config = self._config
        on_cpu = not has_gpu()
        choice = choose_dtype(config.dtype, on_gpu=not on_cpu)
        kv_note = ""
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        if on_cpu:
            kv_cache_gib = kv_cache_gib_for(
                config.kv_cache_gib, kv_models(config), choice.dtype, config.max_model_len
            )
            configure_cpu_runtime(kv_cache_gib, ranks)
            kv_note = f"; KV cache {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB"
        logger.info("dtype %s: %s%s", choice.dtype, choice.reason, kv_note)
        patches = self._usable_patches()
        # vLLM reads its settings from the environment on every access, unless cached
        # (below); an engine started before in this process may have cached them, and
        # this one's processes must see the environment as it is now.
        vllm_envs.disable_envs_cache()
        args = self._engine_args(patches, choice.dtype)
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        if on_cpu and ranks == 1:
            # vllm-cpu moves even one rank into a worker process of its own, as OpenMP
            # could not be bound otherwise; under AsyncLLM the EngineCore is already a
            # process of its own, spawned with the worker's OpenMP environment below, and
            # the extra process held a second interpreter and set of libraries
            # (docs/operations.md, "Memory on a CPU host").
            vllm_config.parallel_config.distributed_executor_backend = "uni"
        patches, runner = registry.fit_model_runner(vllm_config, patches)
        if runner is not None:
            logger.warning("specserve: %s", runner)
        self._patches = patches
        mode = self._mode(vllm_config, patches)
        logger.info(
            "engine: %s speculation, %s model runner, %s scheduling, patches [%s]: %s",
            mode.speculation,
            mode.runner.upper(),
            "async" if mode.async_scheduling else "synchronous",
            ", ".join(mode.patches),
            mode.reason,
        )
        self._start_patches(patches)
        with self._rank_environment(vllm_config, on_cpu and ranks == 1):
            self._llm = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=False)
        # vLLM's engine processes cache its settings once up; this one does too now,
        # nothing here changing them after the engine has spawned: the output
        # handler read them per engine output (docs/benchmarks.md, "Observations behind choices").
        vllm_envs.enable_envs_cache()
        # vLLM's own copy (its renderer's): a second one would hold the vocabulary twice.
        self._tokenizer = self._llm.get_tokenizer()
        self._tool_parser_class = parser_class(config.tool_call_parser)
        vocabulary = self._tokenizer.get_vocab()
        self._fill_in_the_middle_ids = next(
            (
                [vocabulary[token] for token in tokens]
                for tokens in FILL_IN_THE_MIDDLE_TOKENS
                if all(token in vocabulary for token in tokens)
            ),
            None,
        )
        if self._feed is not None:
            self._feed.start()
            if config.speculation_mode == "auto" and config.speculation_script is None:
                await calibrate(self._llm, self.tokenize, config.num_speculative_tokens, self._feed)
        speculation = None
        if config.speculative_method is not None:
            speculation = SpeculationInfo(
                method=config.speculative_method,
                num_speculative_tokens=config.num_speculative_tokens,
                max_batch_size=config.speculation_max_batch_size,
                mode=config.speculation_mode if self._feed is not None else "fixed",
            )
        self._info = EngineInfo(
            model_name=config.served_model_name,
            max_model_len=self._llm.model_config.max_model_len,
            vocab_size=self._llm.model_config.get_vocab_size(),
            created=int(time.time()),
            speculation=speculation,
            # vLLM's resolved dtype: concrete even where "auto" was passed (GPU).
            dtype=str(self._llm.model_config.dtype).removeprefix("torch."),
            dtype_reason=choice.reason,
            mode=mode,
        )
        if on_cpu:
            if ranks == 1:
                # Run in the EngineCore, where the rank is (vLLM's uni executor unpickles a
                # function passed as bytes; its mp executor would pickle the bytes again).
                await self._llm.collective_rpc(cloudpickle.dumps(release_free_heap))
            release_free_heap()
            self._planned = self._planned_memory(choice.dtype)
            report = self._memory_report()
            if report is not None:
                logger.info("%s", report.line())

    @property
    def _int8_head(self) -> bool:
        """Whether the target's head is served in int8 (the patch that quantizes it is on)."""
        return self._config.int8_head and "cpu_embedding_memory" in self._patches

    def _planned_memory(self, dtype: str) -> tuple[dict[str, int], int, int] | None:
        """Each local model's weights as served in `dtype`, the KV cache size and the lookups'
        trees at their bound (0 without lookups), in bytes."""
        folders = [Path(model) for model in kv_models(self._config)]
        if not all(folder.is_dir() for folder in folders):
            return None
        weights = {
            role: weights_as_served(folder, dtype, int8_head=self._int8_head and role == "target")
            for role, folder in zip(("target", "draft"), folders, strict=False)
        }
        config = self._config
        trees = 0
        if config.speculative_method == "hybrid" and "lookup" in self._patches:
            max_model_len = self.info().max_model_len
            trees = lookup_trees_bound(
                config.lookup_index_tokens, config.max_num_seqs, max_model_len
            )
        return weights, int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30, trees

    def _memory_report(self) -> MemoryReport | None:
        """What the server's processes hold now against what was planned (CPU, local models)."""
        if self._planned is None:
            return None
        weights, kv_cache, trees = self._planned
        return MemoryReport(server_processes(), weights, kv_cache, trees)

    def memory(self) -> dict[str, Any] | None:
        report = self._memory_report()
        return None if report is None else report.as_dict()

    def _engine_args(self, patches: list[str], dtype: str) -> Any:
        """vLLM's AsyncEngineArgs for this engine with these patches in force."""
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        config = self._config
        autopilot = "autopilot" in patches
        lookups = "lookup" in patches
        synchronous = any(registry.BY_NAME[name].synchronous for name in patches)
        return AsyncEngineArgs(
            # llguidance: the widest JSON Schema coverage of vLLM's grammar backends.
            structured_outputs_config=StructuredOutputsConfig(
                backend="guidance", disable_any_whitespace=grammar.COMPACT_JSON
            ),
            model=config.model,
            quantization=config.quantization,  # type: ignore[arg-type]  # vLLM's names
            served_model_name=config.served_model_name,
            dtype=dtype,  # type: ignore[arg-type]  # vLLM's names
            seed=config.seed,
            max_model_len=config.max_model_len,  # type: ignore[arg-type]  # None: model's own
            max_num_seqs=config.max_num_seqs,
            # Requests carry the admission's priority (their tenant's share when admitted):
            # vLLM serves the smallest first, and preempts by it when the KV cache runs out.
            scheduling_policy="priority",
            block_size=config.block_size,
            enable_prefix_caching=config.prefix_caching,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            distributed_executor_backend=config.distributed_executor_backend,
            speculative_config=self._speculative_config(autopilot, lookups),
            scheduler_cls=autopilot_patch.SCHEDULER_CLASS if autopilot else None,
            # The patches assume the synchronous scheduler (vLLM 0.33 schedules draft models
            # asynchronously on GPUs by default, and would then never hand the scheduler its
            # drafts); without them, vLLM's own choice.
            async_scheduling=False if synchronous else None,
            # vLLM refuses per-request speculation metrics without speculation;
            # "detailed" lists each verify step's draft count (the K it used).
            per_request_spec_decode_metrics="none"
            if config.speculative_method is None
            else "detailed",
            enforce_eager=config.enforce_eager,
            disable_log_stats=False,
            use_tqdm_on_load=config.progress_bars,
        )

    def _mode(self, vllm_config: Any, patches: list[str]) -> EngineMode:
        """How the engine runs, read from vLLM's resolved config (runner, scheduling)."""
        from vllm.config import CompilationMode

        engine_patches = [name for name in patches if registry.BY_NAME[name].synchronous]
        if engine_patches and not has_gpu():
            reason = "CPU: specserve's engine patches, tested on vllm-cpu"
        elif engine_patches:
            reason = (
                "GPU with --gpu-engine-patches: specserve's engine patches, which have "
                "never run on a GPU"
            )
        elif not self._config.engine_patches:
            reason = (
                "GPU: vLLM's own speculation, model runner and scheduling, the path vLLM "
                "tests; specserve's engine patches have never run on a GPU "
                "(--gpu-engine-patches turns them on)"
            )
        else:
            reason = "specserve's engine patches are off (see the lines above)"
        return EngineMode(
            speculation="specserve" if engine_patches else "vllm",
            runner="v2" if vllm_config.use_v2_model_runner else "v1",
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            compiled=vllm_config.compilation_config.mode != CompilationMode.NONE,
            patches=tuple(patches),
            reason=reason,
        )

    @staticmethod
    def _rank_environment(
        vllm_config: Any, rank_in_engine_core: bool
    ) -> AbstractContextManager[None]:
        """The OpenMP environment vLLM gives the worker process of a CPU rank (each thread bound
        to a core of VLLM_CPU_OMP_THREADS_BIND, threads waiting 5 ms before they sleep), for the
        EngineCore while it spawns where the rank runs in it: vLLM's uni executor sets none, and
        Intel OpenMP's own default spins 200 ms after every parallel region, on cores the front
        end needs between steps (docs/benchmarks.md, "Observations behind choices")."""
        if not rank_in_engine_core:
            return nullcontext()
        # registry.CPU_RANK_ENVIRONMENT: what `make check-vllm` checks of it.
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        return OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0)

    def _usable_patches(self) -> list[str]:
        """The vLLM patches this engine can apply (registry.py), one warning per missing
        piece of the others; the autopilot's feed where its scheduler will run. None on a
        GPU without --gpu-engine-patches."""
        config = self._config
        if not config.engine_patches:
            self._patches_off = (
                "specserve's engine patches, off on GPUs: start the server with "
                "--gpu-engine-patches (untested on GPUs)"
            )
            return []
        distribution, version = vllm_distribution()
        lookups = config.speculative_method == "hybrid"
        asked = frozenset(
            ["draft_vocab"] * (config.draft_vocab_size is not None) + ["lookup"] * lookups
        )
        patches, lines = registry.usable(
            vllm_source.installed_source(),
            distribution,
            config.speculative_method is not None,
            asked,
        )
        for line in lines:
            logger.warning("specserve: %s %s", version, line)
        if "autopilot" in patches:
            self._feed = AutopilotFeed(config.served_model_name)
        elif config.speculative_method is not None:
            self._patches_off = (
                "the speculation autopilot's scheduler, which this vLLM version lacks "
                "(see the startup log)"
            )
            logger.warning(
                "speculation autopilot unavailable: fixed K=%d", config.num_speculative_tokens
            )
        return patches

    def _start_patches(self, patches: list[str]) -> None:
        """What vLLM's processes need to know, in the one channel they read (set before they
        spawn); vLLM's refusal of logit_bias with speculation lifted in this process."""
        from server.engine import logit_bias
        from server.vllm_plugins import cpu_memory

        config = self._config
        settings: dict[str, Any] = {"patches": patches}
        if self._feed is not None:
            trace = config.speculation_trace
            settings["report_socket"] = self._feed.path
            settings["autopilot"] = {
                "mode": "script"
                if config.speculation_script is not None
                else config.speculation_mode,
                "max_batch_size": config.speculation_max_batch_size,
                "script": config.speculation_script,
                "trace": str(trace.resolve()) if trace else None,
                "draft_k_max": config.num_speculative_tokens,
            }
            if "lookup" in patches:
                settings["autopilot"]["lookup"] = {
                    "max_tokens": config.lookup_max_tokens,
                    "index_tokens": config.lookup_index_tokens,
                }
        if "draft_vocab" in patches:
            settings["draft_vocab"] = {
                "ranking": str(config.draft_vocab_ranking),
                "size": config.draft_vocab_size,
            }
        if self._int8_head:
            settings["int8_head"] = True
        os.environ[patching.SETTINGS_ENV] = json.dumps(settings)
        if "logit_bias" in patches:
            # The autopilot's scheduler keeps biased requests off drafts.
            logit_bias.allow_in_request_checks()
        if "cpu_embedding_memory" in patches:
            # vLLM's renderer loads this process's tokenizers (the plugins ran before the
            # patches were chosen here).
            cpu_memory.hold_tokenizers_once()

    def _speculative_config(self, autopilot: bool, lookups: bool) -> dict[str, Any] | None:
        config = self._config
        if config.speculative_method is None:
            return None
        # With the autopilot the scheduler sets K every step; the table must
        # still exist, or vLLM pads every request to K drafts. Without it, a table only
        # where K changes with the batch (on a GPU a table costs vLLM's full CUDA graphs).
        cut_off = config.max_num_seqs if autopilot else config.speculation_max_batch_size
        # vLLM's K bounds every proposal it verifies: lookups may be longer than the draft's
        # (the scheduler keeps the draft to num_speculative_tokens).
        k = config.num_speculative_tokens
        if lookups:
            k = max(k, config.lookup_max_tokens)
        spec: dict[str, Any] = {
            # Hybrid is vLLM's draft model; specserve's scheduler adds the lookups.
            "method": "draft_model"
            if config.speculative_method == "hybrid"
            else config.speculative_method,
            "num_speculative_tokens": k,
        }
        if autopilot or cut_off < config.max_num_seqs:
            spec["num_speculative_tokens_per_batch_size"] = speculation_schedule(
                k, cut_off, config.max_num_seqs
            )
        if config.speculative_method in DRAFT_METHODS:
            spec["model"] = config.draft_model
            if config.draft_quantization is not None:
                spec["quantization"] = config.draft_quantization
        else:
            spec["prompt_lookup_max"] = 4
            spec["prompt_lookup_min"] = 2
        return spec

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    def unfinished_requests(self) -> int:
        return 0 if self._llm is None else int(self._llm.get_num_unfinished_requests())

    def autopilot_state(self) -> dict[str, Any] | None:
        if self._feed is None:
            return None
        state = {**self._feed.scheduler(), **self._feed.draft(), **self._feed.draft_head()}
        state.pop("source", None)
        return state

    def info(self) -> EngineInfo:
        assert self._info is not None, "engine not started"
        return self._info

    def tokenize(self, text: str) -> list[int]:
        with self._tokenizing:
            return list(self._tokenizer.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int]) -> str:
        with self._tokenizing:
            return str(self._tokenizer.decode(token_ids))

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        with self._tokenizing:
            try:
                text = self._tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # the template itself rejects the conversation
                raise InvalidRequestError(
                    f"chat template rejected the messages: {exc}", param="messages"
                ) from exc
            return list(self._tokenizer.encode(text, add_special_tokens=False))

    def tool_call_parser(self) -> ToolCallParser:
        assert self._tool_parser_class is not None, "engine not started"
        return VllmToolCallParser(self._tool_parser_class, self._tokenizer)

    def render_fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        if self._fill_in_the_middle_ids is None:
            raise InvalidRequestError(
                f"suffix (fill in the middle) needs a model with fill-in-the-middle tokens; "
                f"{self.info().model_name} has none",
                param="suffix",
            )
        prefix_id, suffix_id, middle_id = self._fill_in_the_middle_ids

        def encode(text: str) -> list[int]:
            with self._tokenizing:
                return list(self._tokenizer.encode(text, add_special_tokens=False))

        return [prefix_id, *encode(prefix), suffix_id, *encode(suffix), middle_id]

    async def check_health(self) -> bool:
        if self._llm is None:
            return False
        try:
            await self._llm.check_health()
        except Exception:
            return False
        return True

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def validate(self, request: GenerationRequest) -> None:
        """Refuse what vLLM would refuse, before any response is sent: the checks its
        input processor runs when the request arrives (a JSON schema its grammar backend
        cannot compile among them), run here so a stream never starts with them. The
        schema's grammar is bounded first, so vLLM's builds of it are too."""
        from vllm.exceptions import VLLMClientError

        if self._llm is None:
            raise EngineUnavailableError("the engine is not running")
        self.check_patched_features(request.sampling)
        if request.sampling.json_format is not None:
            grammar.check(request.sampling.json_format, self._config.max_grammar_symbols)
        params = sampling_params(request.sampling)
        vllm_config = self._llm.vllm_config
        try:
            params.verify(
                self._llm.model_config,
                vllm_config.speculative_config,
                vllm_config.structured_outputs_config,
                self._tokenizer,
            )
        except (ValueError, VLLMClientError) as exc:
            param = getattr(exc, "parameter", None)
            if param is None and request.sampling.json_format is not None:
                # What vLLM checks beyond our protocol: the schema, and where it came from.
                param = request.sampling.json_format.param
            raise InvalidRequestError(str(exc), param=param) from exc

    def check_patched_features(self, sampling: SamplingOptions) -> None:
        """Refuse what only an engine patch that is off would honour, naming what enables it."""
        if self._config.speculative_method is None:
            return
        if sampling.max_draft_tokens is not None and self._feed is None:
            # Only specserve's scheduler reads the cap; vLLM's would draft regardless.
            raise InvalidRequestError(
                f"speculation.max_draft_tokens needs {self._patches_off}", param="speculation"
            )
        if sampling.logit_bias and "logit_bias" not in self._patches:
            # vLLM refuses logit_bias with speculation; its message names no way out.
            raise InvalidRequestError(
                f"logit_bias with speculation needs {self._patches_off}", param="logit_bias"
            )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if self._llm is None:
            raise EngineUnavailableError("the engine is not running")
        params = sampling_params(
            request.sampling, request.stream, request.tenant, request.request_id
        )
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        salt = self._cache_salt(request)
        if salt is not None:
            prompt["cache_salt"] = salt
        stream = self._llm.generate(prompt, params, request.request_id, priority=request.priority)
        finished = False
        # Per choice: tokens so far, for the K=0 steps of its speculation stats.
        produced: dict[int, int] = {}
        lookups = FinishedLookups()
        idle_before = self._feed.idle_reasons() if self._feed is not None else None
        try:
            while not finished:
                # Only vLLM's own failures are mapped here; ours stay bugs (500).
                try:
                    output = await anext(stream)
                except StopAsyncIteration:
                    return
                except EngineDeadError as exc:
                    raise EngineUnavailableError("the engine stopped; request lost") from exc
                except VLLMClientError as exc:
                    raise InvalidRequestError(str(exc)) from exc
                except EngineGenerateError as exc:
                    raise InternalError(f"generation failed for {request.request_id}") from exc
                finished = output.finished
                lookups.add(output.kv_transfer_params)
                choices = []
                for completion in output.outputs:
                    produced[completion.index] = produced.get(completion.index, 0) + len(
                        completion.token_ids
                    )
                    speculation = None
                    if completion.spec_decode_metrics is not None:
                        speculation = self._speculation_stats(
                            completion.spec_decode_metrics,
                            produced[completion.index],
                            lookups.take(),
                            idle_before,
                        )
                    choices.append(
                        choice(completion, request.sampling.logprobs, speculation, self._tokenizer)
                    )
                yield EngineOutput(
                    prompt_tokens=len(output.prompt_token_ids or request.prompt_token_ids),
                    cached_tokens=output.num_cached_tokens or 0,
                    choices=choices,
                    token_times=None if request.stream else token_times(output.metrics),
                )
        finally:
            # A consumer that stops early (client gone, error downstream) must
            # not leave the sequence running in the engine.
            if not finished:
                await stream.aclose()
                await self.abort(request.request_id)

    def _cache_salt(self, request: GenerationRequest) -> str | None:
        """What keeps a tenant's cached prefixes its own: vLLM hashes the salt into a prompt's
        first block, so prompts of two tenants share no block. None where tenants share."""
        if self._config.shared_prefix_cache or request.tenant is None:
            return None
        return request.tenant

    def _speculation_stats(
        self,
        metrics: Any,
        tokens: int,
        lookups: tuple[int, int],
        idle_before: Counter[str] | None,
    ) -> SpeculationStats:
        """vLLM's per-sequence counts, the K of each of its steps, its lookups' counts, and
        why the draft idled while it ran: the most frequent of the autopilot's step reasons
        over its lifetime. Those counters are the server's, so the reasons that a neighbour's
        own parameters caused are left out (`NEIGHBOURS_OWN`): the serving layer says those
        from the request's own."""
        stats = speculation_stats(metrics, tokens, lookups)
        if self._feed is None or idle_before is None or stats.steps_by_k.get(0, 0) == 0:
            return stats
        idle = self._feed.idle_reasons() - idle_before
        for neighbours in NEIGHBOURS_OWN:
            del idle[neighbours]
        reason = idle.most_common(1)[0][0] if idle else None
        return replace(stats, idle_reason=reason)
