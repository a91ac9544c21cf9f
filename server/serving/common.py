"""Serving logic shared by completions, chat and the Responses API: checks, limits, fan-out
of a request's generations, usage and the speculation summary.

Everything that happens before the first byte is sent (request limits, model name,
context length) raises an `APIError` the HTTP layer turns into a status code; once a
stream is under way, sse.py turns errors into events.
"""

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from server.autopilot.idle import IdleReason
from server.engine.contract import (
    Engine,
    EngineOutput,
    GenerationRequest,
    JsonFormat,
    SamplingOptions,
)
from server.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTimeoutError,
)
from server.protocol.common import (
    PromptTokensDetails,
    ResponseFormat,
    SamplingFields,
    SourceCounts,
    SpeculationSummary,
    Usage,
    draft_cap,
    lookups_wanted,
)
from server.protocol.limits import LimitExceededError
from server.serving.observer import RequestObserver

logger = logging.getLogger(__name__)
Body = TypeVar("Body")


def new_id(prefix: str, separator: str = "-") -> str:
    # OpenAI's ids: "chatcmpl-..." and "cmpl-...", but "resp_..." and its items' "msg_...".
    return f"{prefix}{separator}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def within_limits(check: Callable[[Body], None], body: Body) -> None:
    """A body over one of the server's request limits (`check`, a `RequestLimits` method) is
    a 400 naming the parameter, and in its message the flag that raises the limit."""
    try:
        check(body)
    except LimitExceededError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None


def json_format(response_format: ResponseFormat | None) -> JsonFormat | None:
    """The JSON constraint a response_format asks for, if any."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.json_schema is None:
        return JsonFormat()
    return JsonFormat(response_format.json_schema.schema_)


def logit_bias(engine: Engine, body: SamplingFields) -> Mapping[int, float] | None:
    """The request's logit_bias by token id, without its entries of 0 (None when nothing is
    left); ids outside the target's vocabulary are a 400 naming it, zero entries included (the
    protocol already checked their form and values). A biased request gets no drafts, so a
    bias of 0, which changes nothing, must not cost the request its speculation."""
    if not body.logit_bias:
        return None
    vocab_size = engine.info().vocab_size
    bias = {int(token): value for token, value in body.logit_bias.items()}
    outside = sorted(token for token in bias if token >= vocab_size)
    if outside:
        raise InvalidRequestError(
            f"logit_bias token ids must be below the vocabulary size {vocab_size}; "
            f"got {outside[:5]}",
            param="logit_bias",
        )
    applied = {token: value for token, value in bias.items() if value != 0}
    return MappingProxyType(applied) if applied else None


def sampling_options(
    body: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    grammar: JsonFormat | None,
    bias: Mapping[int, float] | None,
) -> SamplingOptions:
    """The engine's options for a chat or completions body (the two share their sampling
    fields; how many logprobs and which grammar each endpoint reads its own way; `bias` is
    `logit_bias(engine, body)`, checked once per body)."""
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        n=body.n,
        stop=body.stop_list(),
        seed=body.seed,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        json_format=grammar,
        logit_bias=bias,
        max_draft_tokens=draft_cap(body.speculation),
        lookups=lookups_wanted(body.speculation),
    )


def validate_all(engine: Engine, requests: list[GenerationRequest]) -> None:
    for request in requests:
        engine.validate(request)


def check_model(engine: Engine, requested: str) -> str:
    served = engine.info().model_name
    if requested != served:
        raise ModelNotFoundError(
            f"The model '{requested}' does not exist; this server serves '{served}'",
            param="model",
        )
    return served


def resolve_max_tokens(
    engine: Engine, prompt_tokens: int, requested: int | None, prompt_param: str, param: str
) -> int:
    """Tokens to generate: the request's limit, or what fits in the context."""
    limit = engine.info().max_model_len
    if prompt_tokens >= limit:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{prompt_tokens} tokens; shorten the prompt",
            param=prompt_param,
        )
    if requested is None:
        return limit - prompt_tokens
    if prompt_tokens + requested > limit:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} "
            f"for the completion); reduce the prompt or {param}",
            param=param,
        )
    return requested


async def generate_all(
    engine: Engine,
    requests: list[GenerationRequest],
    observer: RequestObserver,
    deadline: float | None,
) -> AsyncGenerator[tuple[int, EngineOutput], None]:
    """Run the engine requests of one API request; yield (request position, output).

    Every output passes through `observer` first, which is finished however
    the request ends. Leaving early (client gone, error, `deadline` passed)
    closes every engine stream at once, and each aborts its own request.
    Iterate it from one task: the deadline cancels that task's wait.
    """
    completed = False
    waits = _EngineWaits(deadline)
    try:
        async with aclosing(_merged(engine, requests)) as outputs:
            while True:
                try:
                    position, output = await waits.next(outputs)
                except StopAsyncIteration:
                    break
                observer.on_output(position, output)
                yield position, output
        completed = True
    finally:
        waits.close()
        observer.finish(completed)
        logger.info(
            "%s %s: %d prompt and %d output tokens",
            observer.endpoint,
            "finished" if completed else "stopped early",
            observer.prompt_tokens,
            observer.output_tokens,
        )


@dataclass(frozen=True)
class Caller:
    """What the middlewares learnt of a generation request, which its preparation needs."""

    arrival: float  # time.perf_counter() when it arrived: TTFT and end-to-end count from here
    tenant: str  # the API key's tenant
    priority: int  # the engine's scheduling priority, from admission (smaller goes first)
    deadline: float | None  # time.perf_counter() by which generation must end


class _EngineWaits:
    """A request's waits for the engine, bounded by its deadline.

    Only the wait for the engine is bounded, never our own sending (a slow client
    is the disconnect handling's job): a deadline that passes while we send stops
    the request at its next wait. One timer per request, which cancels the
    waiting task only while it waits, rather than `asyncio.timeout` around each
    wait, whose entering and leaving per output was a visible share of a busy
    event loop (docs/benchmarks.md, "Observations behind choices").
    """

    def __init__(self, deadline: float | None) -> None:
        # The task that iterates the request's outputs, looked up once: asyncio's
        # current_task is Python code in 3.11.
        task = asyncio.current_task()
        assert task is not None  # made while generate_all runs, so inside a task
        self._task = task
        self._expired = False
        self._waiting = False
        self._cancelled = False  # the timer cancelled the waiting task
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(deadline - time.perf_counter(), self._expire)

    def _expire(self) -> None:
        self._expired = True
        if self._waiting:
            self._cancelled = True
            self._task.cancel()

    async def next(
        self, outputs: AsyncIterator[tuple[int, EngineOutput]]
    ) -> tuple[int, EngineOutput]:
        if self._expired:
            raise _timed_out()
        self._waiting = True
        try:
            return await anext(outputs)
        except asyncio.CancelledError:
            # Ours becomes the timeout; any other cancellation (client gone,
            # shutdown) goes on, as with asyncio.timeout.
            if self._cancelled and self._task.uncancel() == 0:
                raise _timed_out() from None
            raise
        finally:
            self._waiting = False

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _timed_out() -> RequestTimeoutError:
    return RequestTimeoutError(
        "The request exceeded the server's request timeout and was stopped; "
        "ask for fewer tokens or retry"
    )


async def _merged(
    engine: Engine, requests: list[GenerationRequest]
) -> AsyncGenerator[tuple[int, EngineOutput], None]:
    if len(requests) == 1:
        async with aclosing(engine.generate(requests[0])) as outputs:
            async for output in outputs:
                yield 0, output
        return
    # Bounded: while the client reads slowly, the producers wait here and the engine's own
    # per-request collector merges the deltas they have not taken, so nothing piles up.
    queue: asyncio.Queue[tuple[int, EngineOutput | Exception | None]] = asyncio.Queue(
        maxsize=len(requests)
    )

    async def produce(position: int, request: GenerationRequest) -> None:
        try:
            async with aclosing(engine.generate(request)) as outputs:
                async for output in outputs:
                    await queue.put((position, output))
        except Exception as exc:  # handed to the consumer, which re-raises
            await queue.put((position, exc))
            return
        await queue.put((position, None))

    tasks = [asyncio.create_task(produce(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(observer: RequestObserver) -> Usage:
    prompt, completion = observer.prompt_tokens, observer.output_tokens
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=observer.cached_tokens),
    )


def speculation_summary(
    engine: Engine, observer: RequestObserver, sampling: SamplingOptions
) -> SpeculationSummary:
    """What speculation did for this request, from vLLM's per-sequence counts.

    When no draft was verified, `reason` says why, from the request's own parameters first:
    "disabled" (no speculation on this server), "requested_off" (its
    `speculation.max_draft_tokens` is 0), "logit_bias" (it carried one, which drafts must not
    reach); else the autopilot's reason for idling the draft while the request ran
    ("not_paying", "batch_too_large", "calibrating", "lookup", "prefill": every request of
    the step was prefilling after steps of more requests, "too_short": too few tokens left to
    pay back the draft catching up on the prompt), or "too_short" also when the output ended
    before a draft could be verified. A neighbour's logit_bias or cap never idles this
    request's steps, and its reason never names them (the engine's `idle_reason`).
    """
    config = engine.info().speculation
    if config is None:
        return SpeculationSummary(applied=False, reason=IdleReason.DISABLED)
    stats = observer.speculation
    drafts = sum(s.drafts for s in stats)
    draft_tokens = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    # Every sequence of one server has K positions.
    per_position = [
        sum(column) for column in zip(*(s.accepted_per_position for s in stats), strict=True)
    ]
    steps_by_k: Counter[int] = Counter()
    for s in stats:
        steps_by_k.update(s.steps_by_k)
    summary = SpeculationSummary(
        applied=drafts > 0,
        mode=config.mode,
        method=config.method,
        num_speculative_tokens=config.num_speculative_tokens,
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        accepted_per_position=per_position,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        steps_by_k={str(k): n for k, n in sorted(steps_by_k.items())},
    )
    if config.method == "hybrid":
        looked_up = sum(s.lookup_tokens for s in stats)
        looked_up_accepted = sum(s.lookup_accepted_tokens for s in stats)
        summary.by_source = {
            "draft": SourceCounts(
                draft_tokens=draft_tokens - looked_up, accepted_tokens=accepted - looked_up_accepted
            ),
            "lookup": SourceCounts(draft_tokens=looked_up, accepted_tokens=looked_up_accepted),
        }
    if not drafts and sampling.max_draft_tokens == 0:
        summary.reason = IdleReason.REQUESTED_OFF  # whatever its neighbours' steps did
    elif not drafts and sampling.logit_bias:
        summary.reason = IdleReason.LOGIT_BIAS  # its own bias kept drafts away from it
    elif not drafts:
        reasons = Counter(s.idle_reason for s in stats if s.idle_reason is not None)
        summary.reason = reasons.most_common(1)[0][0] if reasons else IdleReason.TOO_SHORT
    return summary
