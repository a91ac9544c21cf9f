"""Logic behind POST /v1/chat/completions: messages and tools through the chat
template, engine outputs to assistant messages (text or tool calls) or chunk deltas."""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from server.engine.contract import (
    Engine,
    GenerationRequest,
    ParsedReply,
    TokenLogprob,
)
from server.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChoiceLogprobs,
    NamedToolChoice,
    TokenLogprobEntry,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
    TopLogprob,
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
from server.serving.tools import (
    Function,
    ReplyCalls,
    ToolCallFragment,
    ToolPlan,
    new_call_id,
    parse_reply,
    plan,
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
    tools: ToolPlan | None


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    functions = [
        Function(t.function.name, t.function.description, t.function.parameters)
        for t in body.offered_tools()
    ]
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return plan(functions, None, choice.function.name, body.parallel_tool_calls)
    return plan(functions, choice, None, body.parallel_tool_calls)


def prepare(
    engine: Engine,
    body: ChatCompletionRequest,
    limits: RequestLimits,
    caller: Caller,
) -> PreparedChat:
    within_limits(limits.check_chat, body)
    model = check_model(engine, body.model)
    tools = tool_plan(body)
    messages = [m.template_dict() for m in body.messages]
    token_ids = engine.render_chat(messages, tools.template_tools() if tools else None)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(engine, len(token_ids), body.token_limit(), "messages", param)
    grammar = (tools.grammar() if tools else None) or json_format(body.response_format)
    bias = logit_bias(engine, body)
    sampling = sampling_options(body, max_tokens, body.logprob_count(), grammar, bias)
    chat_id = new_id("chatcmpl")
    request = GenerationRequest(
        chat_id,
        token_ids,
        sampling,
        stream=body.stream,
        tenant=caller.tenant,
        priority=caller.priority,
    )
    validate_all(engine, [request])
    observer = RequestObserver(model, ENDPOINT, caller.arrival, caller.tenant)
    return PreparedChat(chat_id, now(), model, body, request, observer, caller.deadline, tools)


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
    choices = []
    for index, parts in sorted(texts.items()):
        parsed = parse_reply(engine, prepared.tools, "".join(parts))
        calls = [
            ToolCall(id=new_call_id(), function=ToolCallFunction(name=name, arguments=arguments))
            for name, arguments in parsed.calls
        ]
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=parsed.content, tool_calls=calls or None),
                logprobs=_logprobs(logprobs.get(index, [])) if wants_logprobs else None,
                finish_reason=_finish_reason(finish.get(index), parsed),
            )
        )
    return ChatCompletionResponse(
        id=prepared.id,
        created=prepared.created,
        model=prepared.model,
        choices=choices,
        usage=usage(observer),
        speculation=speculation_summary(engine, observer, prepared.request.sampling),
    )


def _finish_reason(reason: str | None, parsed: ParsedReply) -> str | None:
    # A reply cut off by max_tokens stays "length", calls or not.
    return "tool_calls" if parsed.calls and reason == "stop" else reason


def _call_deltas(fragments: list[ToolCallFragment]) -> list[ToolCallDelta] | None:
    """OpenAI's shape: a call's first delta has its id, type and name."""
    deltas = [
        ToolCallDelta(
            index=f.index,
            id=new_call_id() if f.name is not None else None,
            type="function" if f.name is not None else None,
            function=ToolCallFunctionDelta(name=f.name, arguments=f.arguments),
        )
        for f in fragments
    ]
    return deltas or None


async def stream(engine: Engine, prepared: PreparedChat) -> AsyncIterator[str]:
    def payload(choices: list[ChatChunkChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=prepared.id,
            created=prepared.created,
            model=prepared.model,
            choices=choices,
            **extra,  # type: ignore[arg-type]
        )

    def chunk(choices: list[ChatChunkChoice], **extra: object) -> str:
        return sse(payload(choices, **extra))

    text_chunks = TextEvents(
        lambda index, text: payload([ChatChunkChoice(index=index, delta=ChatDelta(content=text))])
    )

    # OpenAI sends the role alone in each choice's first chunk.
    for index in range(prepared.body.n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    observer = prepared.observer
    tools = prepared.tools
    calls = {i: ReplyCalls.start(engine, tools) for i in range(prepared.body.n)} if tools else {}
    texts: dict[int, str] = {}
    outputs = generate_all(engine, [prepared.request], observer, prepared.deadline)
    async for _, output in outputs:
        for delta in output.choices:
            # Tokens may carry no text yet (a partial character, a held-back
            # stop-string prefix) but still carry logprobs.
            if not (delta.token_ids or delta.finish_reason is not None):
                continue
            content, finish = delta.text, delta.finish_reason
            fragments: list[ToolCallFragment] = []
            if delta.index in calls:
                reply = calls[delta.index]
                texts[delta.index] = texts.get(delta.index, "") + delta.text
                content, fragments = reply.feed(delta.text, delta.token_ids)
                if finish is not None:
                    rest, more, parsed = reply.close(texts[delta.index])
                    content, fragments = content + rest, fragments + more
                    finish = _finish_reason(finish, parsed)
            if not fragments and delta.logprobs is None and finish is None:
                yield text_chunks.render(delta.index, content)
                continue
            yield chunk(
                [
                    ChatChunkChoice(
                        index=delta.index,
                        delta=ChatDelta(
                            content=content if content or not fragments else None,
                            tool_calls=_call_deltas(fragments),
                        ),
                        logprobs=_logprobs(delta.logprobs),
                        finish_reason=finish,
                    )
                ]
            )
    if prepared.body.include_usage_in_stream():
        yield chunk(
            [],
            usage=usage(observer),
            speculation=speculation_summary(engine, observer, prepared.request.sampling),
        )
