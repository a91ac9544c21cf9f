"""Logic behind POST /v1/responses: input items and tools through the chat template,
the reply to output items (a message, function calls), whole or as the Responses
API's typed stream events.

The stream: response.created and response.in_progress; per output item
output_item.added, its content (content_part.added, output_text.delta...,
output_text.done, content_part.done, or function_call_arguments.delta...,
function_call_arguments.done) and output_item.done; then response.completed, or
response.incomplete when max_output_tokens cut the reply. An error after the 200 is
an `error` event, the last one. Every event is `event: <type>` and `data: <json>`
with its type and sequence_number, and there is no [DONE].
"""

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from server.engine.contract import (
    Engine,
    GenerationRequest,
    SamplingOptions,
)
from server.errors import APIError, InvalidRequestError
from server.protocol.common import draft_cap, lookups_wanted
from server.protocol.limits import RequestLimits
from server.protocol.responses import (
    CreateResponseRequest,
    FunctionToolChoice,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    Progress,
    ResponseObject,
    ResponseUsage,
)
from server.serving.common import (
    Caller,
    check_model,
    generate_all,
    json_format,
    new_id,
    now,
    resolve_max_tokens,
    speculation_summary,
    validate_all,
    within_limits,
)
from server.serving.observer import RequestObserver
from server.serving.sse import (
    sse_stream,
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

ENDPOINT = "/v1/responses"
Finished = Literal["completed", "incomplete"]

# The engine names chat's parameters in its refusals; these are their names here.
_PARAMS = {"messages": "input", "response_format": "text.format"}


@dataclass
class PreparedResponse:
    id: str
    created: int
    model: str
    body: CreateResponseRequest
    request: GenerationRequest
    observer: RequestObserver
    deadline: float | None  # time.perf_counter() by which generation must end
    tools: ToolPlan | None


def tool_plan(body: CreateResponseRequest) -> ToolPlan | None:
    functions = [Function(t.name, t.description, t.parameters) for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return plan(functions, None, choice.name, body.parallel_tool_calls)
    return plan(functions, choice, None, body.parallel_tool_calls)


@contextmanager
def _named_for_responses() -> Iterator[None]:
    """Engine refusals inside name this API's parameters."""
    try:
        yield
    except InvalidRequestError as exc:
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise


def prepare(
    engine: Engine,
    body: CreateResponseRequest,
    limits: RequestLimits,
    caller: Caller,
) -> PreparedResponse:
    within_limits(limits.check_response, body)
    model = check_model(engine, body.model)
    tools = tool_plan(body)
    messages = [m.template_dict() for m in body.messages()]
    template_tools = tools.template_tools() if tools else None
    with _named_for_responses():
        token_ids = engine.render_chat(messages, template_tools)
    max_tokens = resolve_max_tokens(
        engine, len(token_ids), body.max_output_tokens, "input", "max_output_tokens"
    )
    sampling = SamplingOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        json_format=(tools.grammar() if tools else None) or json_format(body.response_format()),
        max_draft_tokens=draft_cap(body.speculation),
        lookups=lookups_wanted(body.speculation),
    )
    response_id = new_id("resp", "_")
    request = GenerationRequest(
        response_id,
        token_ids,
        sampling,
        stream=body.stream,
        tenant=caller.tenant,
        priority=caller.priority,
    )
    with _named_for_responses():
        validate_all(engine, [request])
    observer = RequestObserver(model, ENDPOINT, caller.arrival, caller.tenant)
    return PreparedResponse(
        response_id, now(), model, body, request, observer, caller.deadline, tools
    )


def _status(finish_reason: str | None) -> Finished:
    return "incomplete" if finish_reason == "length" else "completed"


def _response(
    engine: Engine,
    prepared: PreparedResponse,
    status: Progress,
    output: list[OutputItem],
) -> ResponseObject:
    """The response object; while in progress, without usage and speculation."""
    body, observer = prepared.body, prepared.observer
    done = status != "in_progress"
    usage = ResponseUsage(
        input_tokens=observer.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=observer.cached_tokens),
        output_tokens=observer.output_tokens,
        total_tokens=observer.prompt_tokens + observer.output_tokens,
    )
    return ResponseObject(
        id=prepared.id,
        created_at=prepared.created,
        status=status,
        incomplete_details=(
            IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        ),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata,
        model=prepared.model,
        output=output,
        parallel_tool_calls=body.parallel_tool_calls,
        temperature=body.temperature,
        text=body.text,
        tool_choice=body.tool_choice,
        tools=body.tools,
        top_p=body.top_p,
        usage=usage if done else None,
        user=body.user,
        speculation=speculation_summary(engine, observer, prepared.request.sampling)
        if done
        else None,
    )


def _message(text: str, status: Progress) -> OutputMessage:
    return OutputMessage(id=new_id("msg", "_"), status=status, content=[OutputText(text=text)])


def _call(name: str, arguments: str, status: Progress) -> OutputFunctionCall:
    return OutputFunctionCall(
        id=new_id("fc", "_"), call_id=new_call_id(), name=name, arguments=arguments, status=status
    )


async def complete(engine: Engine, prepared: PreparedResponse) -> ResponseObject:
    parts: list[str] = []
    finish = None
    outputs = generate_all(engine, [prepared.request], prepared.observer, prepared.deadline)
    async for _, output in outputs:
        for delta in output.choices:
            parts.append(delta.text)
            finish = delta.finish_reason or finish
    parsed = parse_reply(engine, prepared.tools, "".join(parts))
    status = _status(finish)
    # Only the last item can have been cut off.
    items: list[OutputItem] = []
    if parsed.content or not parsed.calls:
        items.append(_message(parsed.content or "", "completed"))
    items += [_call(name, arguments, "completed") for name, arguments in parsed.calls]
    items[-1].status = status
    return _response(engine, prepared, status, items)


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


class _EventWriter:
    """Frames typed events and numbers them, the error event included."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(data)}\n\n"

    def error(self, exc: APIError) -> str:
        return self.event("error", **exc.stream_event_fields())


class _StreamedItems:
    """The output items of a streamed reply, one open at a time: text opens a
    message, a call's name opens a function call, and each closes the other."""

    def __init__(self, writer: _EventWriter) -> None:
        self.writer = writer
        self.items: list[OutputItem] = []
        self.open: OutputMessage | OutputFunctionCall | None = None

    def text(self, delta: str) -> Iterator[str]:
        event = self.writer.event
        if not isinstance(self.open, OutputMessage):
            yield from self.close("completed")
            message = _message("", "in_progress")
            location = {"item_id": message.id, "output_index": len(self.items)}
            yield event(
                "response.output_item.added",
                output_index=len(self.items),
                item=_dump(message.model_copy(update={"content": []})),
            )
            yield event(
                "response.content_part.added",
                **location,
                content_index=0,
                part=_dump(message.content[0]),
            )
            self.open = message
        if delta:
            part = self.open.content[0]
            part.text += delta
            yield event(
                "response.output_text.delta",
                item_id=self.open.id,
                output_index=len(self.items),
                content_index=0,
                delta=delta,
                logprobs=[],
            )

    def call(self, name: str | None, arguments: str) -> Iterator[str]:
        event = self.writer.event
        if name is not None:  # a new call: the parser sends the name first, once
            yield from self.close("completed")
            self.open = _call(name, "", "in_progress")
            yield event(
                "response.output_item.added", output_index=len(self.items), item=_dump(self.open)
            )
        assert isinstance(self.open, OutputFunctionCall)
        if arguments:
            self.open.arguments += arguments
            yield event(
                "response.function_call_arguments.delta",
                item_id=self.open.id,
                output_index=len(self.items),
                delta=arguments,
            )

    def close(self, status: Finished) -> Iterator[str]:
        item, self.open = self.open, None
        if item is None:
            return
        event = self.writer.event
        location = {"item_id": item.id, "output_index": len(self.items)}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            yield event(
                "response.output_text.done",
                **location,
                content_index=0,
                text=part.text,
                logprobs=[],
            )
            yield event("response.content_part.done", **location, content_index=0, part=_dump(part))
        else:
            yield event(
                "response.function_call_arguments.done", **location, arguments=item.arguments
            )
        item.status = status
        yield event("response.output_item.done", output_index=len(self.items), item=_dump(item))
        self.items.append(item)


async def _events(
    engine: Engine, prepared: PreparedResponse, writer: _EventWriter
) -> AsyncIterator[str]:
    started = _dump(_response(engine, prepared, "in_progress", []))
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    items = _StreamedItems(writer)
    reply = ReplyCalls.start(engine, prepared.tools) if prepared.tools else None
    text, finish = "", None
    outputs = generate_all(engine, [prepared.request], prepared.observer, prepared.deadline)
    async for _, output in outputs:
        for delta in output.choices:
            # Tokens may carry no text yet (a partial character, a held-back
            # stop-string prefix).
            if not (delta.token_ids or delta.finish_reason is not None):
                continue
            text += delta.text
            content = delta.text
            fragments: list[ToolCallFragment] = []
            if reply is not None:
                content, fragments = reply.feed(delta.text, delta.token_ids)
                if delta.finish_reason is not None:
                    rest, more, _ = reply.close(text)
                    content, fragments = content + rest, fragments + more
            finish = delta.finish_reason or finish
            if content:
                for event in items.text(content):
                    yield event
            for fragment in fragments:
                for event in items.call(fragment.name, fragment.arguments):
                    yield event
    if not items.items and items.open is None:
        for event in items.text(""):  # an empty reply is an empty message, as unstreamed
            yield event
    status = _status(finish)
    for event in items.close(status):
        yield event
    final = _response(engine, prepared, status, items.items)
    yield writer.event(f"response.{status}", response=_dump(final))


def stream(engine: Engine, prepared: PreparedResponse) -> AsyncIterator[str]:
    writer = _EventWriter()
    return sse_stream(_events(engine, prepared, writer), writer.error, last=None)
