"""Route POST /v1/completions."""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.admission import record_usage
from server.api.deps import EngineDep, LimitsDep
from server.api.instrumentation import caller
from server.api.replies import GENERATION_RESPONSES, event_stream, json_unless_disconnected
from server.protocol.completions import CompletionRequest, CompletionResponse
from server.serving import completions

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineDep, limits: LimitsDep
) -> Response:
    # Tokenizing a long prompt must not stall other streams on the event loop.
    prepared = await asyncio.to_thread(completions.prepare, engine, body, limits, caller(request))
    record_usage(request, prepared.observer)
    if body.stream:
        return event_stream(completions.stream(engine, prepared))
    return await json_unless_disconnected(request, completions.complete(engine, prepared))
