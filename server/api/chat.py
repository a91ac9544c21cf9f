"""Route POST /v1/chat/completions."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.api.deps import EngineDep
from server.api.responses import event_stream, json_unless_disconnected
from server.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from server.serving import chat

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineDep
) -> JSONResponse | StreamingResponse:
    prepared = chat.prepare(engine, body)
    if body.stream:
        return event_stream(chat.stream(engine, prepared))
    return await json_unless_disconnected(request, chat.complete(engine, prepared))
