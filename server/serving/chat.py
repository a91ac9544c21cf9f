"""Logic behind POST /v1/chat/completions: messages through the chat template,
engine outputs to assistant messages or chunk deltas."""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from server.engine.base import Engine, GenerationRequest, SamplingOptions, TokenLogprob
from server.metrics import RequestObserver
from server.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChoiceLogprobs,
    TokenLogprobEntry,
    TopLogprob,
)
from server.serving.common import (
    check_model,
    generate_all,
    json_format,
    new_id,
    now,
    resolve_max_tokens,
    speculation_summary,
    sse,
    usage,
    validate_all,
)

ENDPOINT = "/v1/chat/completions"


@dataclass
class PreparedChat:
    id: str
    created: int
    model: str
    body: ChatCompletionRequest
    request: GenerationRequest
    observer: RequestObserver
    deadline: float | None  # time.perf_counter() by which generation must end


def prepare(
    engine: Engine,
    body: ChatCompletionRequest,
    arrival: float,
    tenant: str,
    deadline: float | None,
) -> PreparedChat:
    model = check_model(engine, body.model)
    messages = [{"role": m.template_role(), "content": m.text()} for m in body.messages]
    token_ids = engine.render_chat(messages)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(engine, len(token_ids), body.token_limit(), "messages", param)
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        n=body.n,
        stop=body.stop_list(),
        seed=body.seed,
        logprobs=body.logprob_count(),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        json_format=json_format(body),
    )
    chat_id = new_id("chatcmpl")
    request = GenerationRequest(chat_id, token_ids, sampling)
    validate_all(engine, [request])
    observer = RequestObserver(model, ENDPOINT, arrival, tenant)
    return PreparedChat(chat_id, now(), model, body, request, observer, deadline)


def _logprobs(entries: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    if entries is None:
        return None
    return ChoiceLogprobs(
        content=[
            TokenLogprobEntry(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode()),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


async def complete(engine: Engine, prepared: PreparedChat) -> ChatCompletionResponse:
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    finish: dict[int, str | None] = {}
    observer = prepared.observer
    outputs = generate_all(engine, [prepared.request], observer, prepared.deadline)
    async for _, output in outputs:
        for delta in output.choices:
            texts.setdefault(delta.index, []).append(delta.text)
            if delta.logprobs is not None:
                logprobs.setdefault(delta.index, []).extend(delta.logprobs)
            if delta.finish_reason is not None:
                finish[delta.index] = delta.finish_reason
    wants_logprobs = prepared.request.sampling.logprobs is not None
    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content="".join(parts)),
            logprobs=_logprobs(logprobs.get(index, [])) if wants_logprobs else None,
            finish_reason=finish.get(index),
        )
        for index, parts in sorted(texts.items())
    ]
    return ChatCompletionResponse(
        id=prepared.id,
        created=prepared.created,
        model=prepared.model,
        choices=choices,
        usage=usage(observer),
        speculation=speculation_summary(engine, observer),
    )


async def stream(engine: Engine, prepared: PreparedChat) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], **extra: object) -> str:
        return sse(
            ChatCompletionChunk(
                id=prepared.id,
                created=prepared.created,
                model=prepared.model,
                choices=choices,
                **extra,  # type: ignore[arg-type]
            )
        )

    # OpenAI sends the role alone in each choice's first chunk.
    for index in range(prepared.body.n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    observer = prepared.observer
    outputs = generate_all(engine, [prepared.request], observer, prepared.deadline)
    async for _, output in outputs:
        for delta in output.choices:
            # Tokens may carry no text yet (a partial character, a held-back
            # stop-string prefix) but still carry logprobs.
            if delta.token_ids or delta.finish_reason is not None:
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=delta.index,
                            delta=ChatDelta(content=delta.text),
                            logprobs=_logprobs(delta.logprobs),
                            finish_reason=delta.finish_reason,
                        )
                    ]
                )
    if prepared.body.include_usage_in_stream():
        yield chunk([], usage=usage(observer), speculation=speculation_summary(engine, observer))
