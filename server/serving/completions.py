"""Logic behind POST /v1/completions: prompts to engine requests, outputs to choices."""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from server.engine.base import (
    ChoiceDelta,
    Engine,
    GenerationRequest,
    SamplingOptions,
    TokenLogprob,
)
from server.errors import InvalidRequestError
from server.protocol.common import Usage
from server.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.serving.common import (
    check_model,
    generate_all,
    new_id,
    now,
    resolve_max_tokens,
    sse,
)


@dataclass
class PreparedCompletion:
    """A validated completion request, ready to run: nothing here can fail as a 4xx."""

    id: str
    created: int
    model: str
    body: CompletionRequest
    requests: list[GenerationRequest]
    echo_texts: list[str]


def prepare(engine: Engine, body: CompletionRequest) -> PreparedCompletion:
    model = check_model(engine, body.model)
    completion_id = new_id("cmpl")
    requests, echo_texts = [], []
    for position, prompt in enumerate(body.prompts()):
        token_ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
        _check_token_ids(token_ids, engine.info().vocab_size)
        max_tokens = resolve_max_tokens(engine, len(token_ids), body.max_tokens, "max_tokens")
        sampling = SamplingOptions(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            n=body.n,
            stop=body.stop_list(),
            seed=body.seed,
            logprobs=body.logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
        )
        requests.append(GenerationRequest(f"{completion_id}-{position}", token_ids, sampling))
        if body.echo:
            echo_texts.append(prompt if isinstance(prompt, str) else engine.decode(prompt))
    return PreparedCompletion(completion_id, now(), model, body, requests, echo_texts)


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
    tokens: int = 0
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


class _Tracker:
    """Per-choice state and token counts across all prompts of one request."""

    def __init__(self, prepared: PreparedCompletion) -> None:
        self.prepared = prepared
        self.choices: dict[int, _ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}

    def index(self, position: int, delta: ChoiceDelta) -> int:
        return position * self.prepared.body.n + delta.index

    def observe(self, position: int, prompt_tokens: int, delta: ChoiceDelta) -> tuple[int, str]:
        """Record a delta; return the choice index and the text to emit."""
        self.prompt_tokens[position] = prompt_tokens
        index = self.index(position, delta)
        state = self.choices.get(index)
        text = delta.text
        if state is None:
            state = self.choices[index] = _ChoiceState()
            if self.prepared.echo_texts:
                text = self.prepared.echo_texts[position] + text
        state.text.append(text)
        state.tokens += len(delta.token_ids)
        if delta.logprobs is not None:
            part = _logprobs(delta.logprobs, state.offset)
            if state.logprobs is None:
                state.logprobs = part
            else:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(state.logprobs, name).extend(getattr(part, name))
            state.offset += sum(len(e.token) for e in delta.logprobs)
        if delta.finish_reason is not None:
            state.finish_reason = delta.finish_reason
        return index, text

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(state.tokens for state in self.choices.values())
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


async def complete(engine: Engine, prepared: PreparedCompletion) -> CompletionResponse:
    tracker = _Tracker(prepared)
    async for position, output in generate_all(engine, prepared.requests):
        for delta in output.choices:
            tracker.observe(position, output.prompt_tokens, delta)
    choices = [
        CompletionChoice(
            index=index,
            text="".join(state.text),
            logprobs=state.logprobs,
            finish_reason=state.finish_reason,
        )
        for index, state in sorted(tracker.choices.items())
    ]
    return CompletionResponse(
        id=prepared.id,
        created=prepared.created,
        model=prepared.model,
        choices=choices,
        usage=tracker.usage(),
    )


async def stream(engine: Engine, prepared: PreparedCompletion) -> AsyncIterator[str]:
    tracker = _Tracker(prepared)

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(
            CompletionResponse(
                id=prepared.id,
                created=prepared.created,
                model=prepared.model,
                choices=choices,
                usage=usage,
            )
        )

    async for position, output in generate_all(engine, prepared.requests):
        for delta in output.choices:
            index, text = tracker.observe(position, output.prompt_tokens, delta)
            logprobs = None
            if delta.logprobs is not None:
                state = tracker.choices[index]
                offset = state.offset - sum(len(e.token) for e in delta.logprobs)
                logprobs = _logprobs(delta.logprobs, offset)
            if text or delta.finish_reason is not None:
                yield chunk(
                    [
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                        )
                    ]
                )
    if prepared.body.include_usage_in_stream():
        yield chunk([], tracker.usage())
