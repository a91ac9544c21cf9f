"""Route POST /v1/chat/completions."""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.admission import record_usage
from server.api.deps import EngineDep, LimitsDep
from server.api.instrumentation import caller
from server.api.replies import GENERATION_RESPONSES, event_stream, json_unless_disconnected
from server.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from server.serving import chat

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=GENERATION_RESPONSES,
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineDep, limits: LimitsDep
) -> Response:
    # Rendering and tokenizing must not stall other streams on the event loop.
    prepared = await asyncio.to_thread(chat.prepare, engine, body, limits, caller(request))
    record_usage(request, prepared.observer)
    if body.stream:
        return event_stream(chat.stream(engine, prepared))
    return await json_unless_disconnected(request, chat.complete(engine, prepared))
