"""How a prepared request becomes an HTTP response: JSON or an SSE stream."""

from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from server.serving.common import sse_stream, until_disconnected

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # Starlette cancels the body iterator when the client disconnects; the
    # cancellation reaches the engine stream, which aborts its request.
    return StreamingResponse(
        sse_stream(events), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def json_unless_disconnected(request: Request, work: Awaitable[BaseModel]) -> JSONResponse:
    response = await until_disconnected(request.is_disconnected, work)
    return JSONResponse(response.model_dump(mode="json"))
