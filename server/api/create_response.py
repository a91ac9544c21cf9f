"""Route POST /v1/responses (OpenAI's Responses API, stateless).

Named for the operation: `api/responses.py` holds the HTTP response helpers.
"""

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.api.admission import record_usage
from server.api.deps import EngineDep, LimitsDep
from server.api.instrumentation import caller
from server.api.replies import TYPED_EVENT_RESPONSES, json_unless_disconnected, sse_response
from server.protocol.responses import CreateResponseRequest, ResponseObject
from server.serving import responses

router = APIRouter()


@router.post("/v1/responses", response_model=ResponseObject, responses=TYPED_EVENT_RESPONSES)
async def create_response(
    body: CreateResponseRequest, request: Request, engine: EngineDep, limits: LimitsDep
) -> Response:
    # Rendering and tokenizing must not stall other streams on the event loop.
    prepared = await asyncio.to_thread(responses.prepare, engine, body, limits, caller(request))
    record_usage(request, prepared.observer)
    if body.stream:
        return sse_response(responses.stream(engine, prepared))
    return await json_unless_disconnected(request, responses.complete(engine, prepared))
