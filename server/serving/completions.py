"""Logic behind POST /v1/completions: prompts to engine requests, outputs to choices."""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from server.engine.contract import (
    ChoiceDelta,
    Engine,
    GenerationRequest,
    TokenLogprob,
)
from server.errors import InvalidRequestError
from server.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.protocol.limits import RequestLimits
from server.serving.common import (
    Caller,
    check_model,
    generate_all,
    json_format,
    logit_bias,
    new_id,
    now,
    resolve_max_tokens,
    sampling_options,
    speculation_summary,
    usage,
    validate_all,
    within_limits,
)
from server.serving.observer import RequestObserver
from server.serving.sse import (
    TextEvents,
    sse,
)

ENDPOINT = "/v1/completions"


@dataclass
class PreparedCompletion:
    """A validated completion request, ready to run: nothing here can fail as a 4xx."""

    id: str
    created: int
    model: str
    body: CompletionRequest
    requests: list[GenerationRequest]
    echo_texts: list[str]
    observer: RequestObserver
    deadline: float | None  # time.perf_counter() by which generation must end


def prepare(
    engine: Engine,
    body: CompletionRequest,
    limits: RequestLimits,
    caller: Caller,
) -> PreparedCompletion:
    within_limits(limits.check_completion, body)
    model = check_model(engine, body.model)
    completion_id = new_id("cmpl")
    bias = logit_bias(engine, body)
    requests, echo_texts = [], []
    for position, prompt in enumerate(body.prompts()):
        if isinstance(prompt, str) and body.suffix is not None:
            token_ids = engine.render_fill_in_the_middle(prompt, body.suffix)
        else:
            token_ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
        _check_token_ids(token_ids, engine.info().vocab_size)
        max_tokens = resolve_max_tokens(
            engine, len(token_ids), body.max_tokens, "prompt", "max_tokens"
        )
        grammar = json_format(body.response_format)
        sampling = sampling_options(body, max_tokens, body.logprobs, grammar, bias)
        requests.append(
            GenerationRequest(
                f"{completion_id}-{position}",
                token_ids,
                sampling,
                body.stream,
                caller.tenant,
                caller.priority,
            )
        )
        if body.echo:
            echo_texts.append(prompt if isinstance(prompt, str) else engine.decode(prompt))
    validate_all(engine, requests)
    observer = RequestObserver(model, ENDPOINT, caller.arrival, caller.tenant)
    return PreparedCompletion(
        completion_id, now(), model, body, requests, echo_texts, observer, caller.deadline
    )


def _check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise InvalidRequestError("prompt must contain at least one token", param="prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt"
        )


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    offset: int = 0
    finish_reason: str | None = None


def _logprobs(entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for entry in entries:
        result.tokens.append(entry.token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(dict(entry.top))
        result.text_offset.append(offset)
        offset += len(entry.token)
    return result


class _Choices:
    """Per-choice state across all prompts of one request."""

    def __init__(self, prepared: PreparedCompletion) -> None:
        self.prepared = prepared
        self.states: dict[int, _ChoiceState] = {}

    def add(self, position: int, delta: ChoiceDelta) -> CompletionChoice:
        """Record a delta; return it as the choice fragment to stream."""
        index = position * self.prepared.body.n + delta.index
        state = self.states.get(index)
        text = delta.text
        if state is None:
            state = self.states[index] = _ChoiceState()
            if self.prepared.echo_texts:
                text = self.prepared.echo_texts[position] + text
        state.text.append(text)
        logprobs = None
        if delta.logprobs is not None:
            logprobs = _logprobs(delta.logprobs, state.offset)
            state.offset += sum(len(e.token) for e in delta.logprobs)
            if state.logprobs is None:
                state.logprobs = CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(state.logprobs, name).extend(getattr(logprobs, name))
        if delta.finish_reason is not None:
            state.finish_reason = delta.finish_reason
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason
        )

    def final(self) -> list[CompletionChoice]:
        return [
            CompletionChoice(
                index=index,
                text="".join(state.text),
                logprobs=state.logprobs,
                finish_reason=state.finish_reason,
            )
            for index, state in sorted(self.states.items())
        ]


async def complete(engine: Engine, prepared: PreparedCompletion) -> CompletionResponse:
    choices = _Choices(prepared)
    observer = prepared.observer
    outputs = generate_all(engine, prepared.requests, observer, prepared.deadline)
    async for position, output in outputs:
        for delta in output.choices:
            choices.add(position, delta)
    return CompletionResponse(
        id=prepared.id,
        created=prepared.created,
        model=prepared.model,
        choices=choices.final(),
        usage=usage(observer),
        speculation=speculation_summary(engine, observer, prepared.requests[0].sampling),
    )


async def stream(engine: Engine, prepared: PreparedCompletion) -> AsyncIterator[str]:
    choices = _Choices(prepared)
    observer = prepared.observer

    def payload(fragments: list[CompletionChoice], **extra: object) -> CompletionResponse:
        return CompletionResponse(
            id=prepared.id,
            created=prepared.created,
            model=prepared.model,
            choices=fragments,
            **extra,  # type: ignore[arg-type]
        )

    def chunk(fragments: list[CompletionChoice], **extra: object) -> str:
        return sse(payload(fragments, **extra))

    text_chunks = TextEvents(
        lambda index, text: payload([CompletionChoice(index=index, text=text)])
    )
    outputs = generate_all(engine, prepared.requests, observer, prepared.deadline)
    async for position, output in outputs:
        for delta in output.choices:
            fragment = choices.add(position, delta)
            # Tokens may carry no text yet (a partial character, a held-back
            # stop-string prefix) but still carry logprobs.
            if not (fragment.text or delta.token_ids or fragment.finish_reason is not None):
                continue
            if fragment.logprobs is not None or fragment.finish_reason is not None:
                yield chunk([fragment])
                continue
            yield text_chunks.render(fragment.index, fragment.text)
    if prepared.body.include_usage_in_stream():
        yield chunk(
            [],
            usage=usage(observer),
            speculation=speculation_summary(engine, observer, prepared.requests[0].sampling),
        )
