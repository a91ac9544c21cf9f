"""The narrow engine contract the HTTP layer depends on (API process).

Everything the serving code needs from an inference engine is here: token
counts, chat and fill-in-the-middle rendering (so limits are checked before
generation), reading tool calls out of replies in the model's own format,
up-front validation of sampling parameters and JSON schemas (so
refusals come before a stream starts), a stream of per-step deltas whose
early close aborts the request, and health.
The vLLM adapter implements it; unit tests use a scripted double. Nothing
here imports vllm or torch.
"""

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class JsonFormat:
    """The reply must be JSON: any object (schema None), or a value matching the schema.
    The engine's grammar constrains every sampled and every verified token to it."""

    schema: dict[str, Any] | None = None
    param: str = "response_format"  # the request field the constraint came from, for errors


@dataclass(frozen=True)
class SamplingOptions:
    """Decoding parameters, already validated by the protocol layer."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # Number of alternatives per position; None means no logprobs at all.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_format: JsonFormat | None = None
    # This request's cap on the drafts it verifies per step; 0: no speculation for it.
    max_draft_tokens: int | None = None
    # False: no looked-up proposals for it (the hybrid), only the draft model's.
    lookups: bool = True
    # Token id -> bias added to its logit before sampling (read-only, e.g. a MappingProxyType);
    # with speculation the engine must keep drafts away from such a request.
    logit_bias: Mapping[int, float] | None = None


@dataclass(frozen=True)
class ParsedReply:
    """A finished reply split into its text and its tool calls (name, JSON arguments)."""

    content: str | None
    calls: list[tuple[str, str]]


class ToolCallParser(Protocol):
    """Reads the tool calls of one choice out of its text, in the model's call format."""

    def parse(self, text: str) -> ParsedReply: ...

    def feed(self, text: str, token_ids: list[int]) -> str:
        """The next streamed delta: the text to send now as content (none of a call,
        and a possible call's start held back)."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    # False: the reply is wanted whole (no streaming). The engine may then send one output at
    # the end, with when its first and last tokens were made (EngineOutput.token_times): no
    # per-token output the client would never see.
    stream: bool = True
    # Whose earlier replies the hybrid proposer may look this request's continuation up in, and
    # whose cached prompt prefixes it may reuse (unless the server shares them).
    tenant: str | None = None
    # The engine's scheduling priority, smaller first: what the request's tenant held when it
    # was admitted (traffic/admission_queue.py); the engine preempts larger for smaller.
    priority: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its logprob and the top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class SpeculationStats:
    """What speculation did for one finished sequence.

    `accepted_per_position[i]` counts verify steps whose draft token at
    position i was accepted (acceptance is a prefix, so it never grows with i).
    """

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    # Engine steps of the sequence by the K its drafts were verified at (0: no draft).
    steps_by_k: dict[int, int] = field(default_factory=dict)
    # Why the draft idled during the sequence's K=0 steps (the autopilot's reason).
    idle_reason: str | None = None
    # Of draft_tokens and accepted_tokens, those looked up rather than drafted (the hybrid).
    lookup_tokens: int = 0
    lookup_accepted_tokens: int = 0


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one sequence (choice) since the previous step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    speculation: SpeculationStats | None = None


@dataclass(frozen=True)
class TokenTimes:
    """When the engine made a reply's first and last tokens (time.perf_counter() seconds)."""

    first: float
    last: float


@dataclass(frozen=True)
class EngineOutput:
    prompt_tokens: int
    choices: list[ChoiceDelta]
    # Set on a whole reply sent at once (GenerationRequest.stream False): its tokens' times,
    # which its arrival cannot tell.
    token_times: TokenTimes | None = None
    # Prompt tokens whose KV came from the prefix cache (known from the first output on).
    cached_tokens: int = 0


@dataclass(frozen=True)
class SpeculationInfo:
    method: str
    num_speculative_tokens: int  # K (fixed) or the largest K (auto)
    max_batch_size: int  # fixed mode's cut-off
    mode: str = "fixed"  # "auto": the autopilot picks K each step


@dataclass(frozen=True)
class EngineMode:
    """How the engine runs inside vLLM, for the startup line and /health."""

    speculation: str  # "vllm": vLLM's own; "specserve": with specserve's patches in its engine
    runner: str  # vLLM's model runner: "v1" or "v2"
    async_scheduling: bool  # vLLM's scheduling mode, as its config resolved it
    compiled: bool  # the models run through torch.compile (not --enforce-eager)
    patches: tuple[str, ...]  # specserve's patches in force inside vLLM's engine
    reason: str


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    created: int  # unix time the engine started, reported by /v1/models
    speculation: SpeculationInfo | None = None
    dtype: str = "unknown"  # what the weights run in, e.g. "float32"
    dtype_reason: str = ""  # why: "set by --dtype", or what the hardware offers
    mode: EngineMode | None = None


class Engine(Protocol):
    """What an inference engine offers the server."""

    def info(self) -> EngineInfo: ...

    def tokenize(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The prompt for a conversation (OpenAI message dicts, tool calls' arguments
        as objects) through the model's chat template, with the tools it may call."""

    def tool_call_parser(self) -> ToolCallParser:
        """A fresh parser for one choice's tool calls, in the model's call format."""

    def render_fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        """The prompt asking for the text between prefix and suffix, in the model's
        fill-in-the-middle tokens; InvalidRequestError if its tokenizer has none."""

    def validate(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError for parameters the engine would refuse."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """Per-step deltas (for a request that is not streamed, possibly one output with
        everything and its token times); closing the iterator early aborts the request."""

    async def check_health(self) -> bool: ...

    def unfinished_requests(self) -> int:
        """Requests the engine holds, waiting or running: 0 once every request has ended or
        been aborted (what a leak would leave above 0)."""

    def memory(self) -> dict[str, Any] | None:
        """What the server's processes hold now (private bytes each) against the weights as
        served and the KV cache; None where it is not measured (GPUs, hub models)."""

    def autopilot_state(self) -> dict[str, Any] | None:
        """What the speculation autopilot measured and decided last (its cost
        model, acceptance by position, K and why); None without it."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
