"""Route POST /v1/completions."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.api.deps import EngineDep
from server.api.responses import event_stream, json_unless_disconnected
from server.protocol.completions import CompletionRequest, CompletionResponse
from server.serving import completions

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineDep
) -> JSONResponse | StreamingResponse:
    prepared = completions.prepare(engine, body)
    if body.stream:
        return event_stream(completions.stream(engine, prepared))
    return await json_unless_disconnected(request, completions.complete(engine, prepared))
