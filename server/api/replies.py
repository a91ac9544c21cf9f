"""How a prepared request, or an error, becomes an HTTP response: JSON or an SSE stream,
and what happens when the client leaves first."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.errors import APIError
from server.protocol.chat import ChatCompletionResponse
from server.protocol.common import ErrorResponse
from server.protocol.completions import CompletionResponse
from server.protocol.responses import ResponseObject
from server.serving.sse import (
    sse_stream,
)

T = TypeVar("T")
GenerationResult = CompletionResponse | ChatCompletionResponse | ResponseObject


def error_response(error: APIError) -> JSONResponse:
    """An error before any byte of the reply was sent: its status, headers and OpenAI body."""
    return JSONResponse(error.to_body(), status_code=error.status, headers=error.headers)


def error_responses(*statuses: int | str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the errors a route can send, all in OpenAI's shape.
    A "default" entry covers the rest (a 500) and keeps FastAPI from
    documenting a 422 we never send."""
    return {
        status: {"model": ErrorResponse, "description": _ERRORS[status]}
        for status in (*statuses, "default")
    }


_ERRORS: dict[int | str, str] = {
    400: "Invalid request: the message names the parameter",
    401: "Missing or wrong API key",
    404: "Unknown model or route",
    413: "Request body over the size limit",
    429: "Tenant rate limit reached (Retry-After, x-ratelimit-* headers)",
    503: "Engine unavailable, server at capacity or shutting down (Retry-After)",
    504: "Request deadline passed; the generation was stopped",
    "default": "Any other error",
}


def _stream_200(description: str, fields: list[str]) -> dict[int | str, dict[str, Any]]:
    """The 200 of a generation route, whose `stream: true` sends server-sent events
    with these fields."""
    return {
        200: {
            "description": description,
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "required": fields,
                        "properties": {field: {"type": "string"} for field in fields},
                    }
                }
            },
        }
    }


_GENERATION_ERRORS = error_responses(400, 401, 404, 413, 429, 503, 504)
GENERATION_RESPONSES = {
    # One event: its data is a chunk as JSON, an error as JSON, or [DONE].
    **_stream_200(
        "The response, or with `stream: true` server-sent events ending in `data: [DONE]`", ["data"]
    ),
    **_GENERATION_ERRORS,
}
# The Responses API's typed events: `event` is the type, `data` the event as JSON.
TYPED_EVENT_RESPONSES = {
    **_stream_200(
        "The response, or with `stream: true` typed server-sent events ending "
        "in response.completed, response.incomplete or error",
        ["event", "data"],
    ),
    **_GENERATION_ERRORS,
}

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Chunks as data events, ending in [DONE]."""
    return sse_response(sse_stream(events))


def sse_response(framed: AsyncIterator[str]) -> StreamingResponse:
    # Starlette cancels the body iterator when the client disconnects; the
    # cancellation reaches the engine stream, which aborts its request.
    return StreamingResponse(framed, media_type="text/event-stream", headers=SSE_HEADERS)


# nginx's "client closed request": nobody reads it, but logs and metrics do.
CLIENT_CLOSED_REQUEST = 499


async def json_unless_disconnected(request: Request, work: Awaitable[GenerationResult]) -> Response:
    response = await until_disconnected(request.is_disconnected, work)
    if response is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # By alias: a response may echo a request's `schema`, held as `schema_`.
    body = response.model_dump(mode="json", by_alias=True)
    return JSONResponse(body, headers=speculation_headers(response))


async def until_disconnected(
    is_disconnected: Callable[[], Awaitable[bool]], work: Awaitable[T], poll_seconds: float = 0.5
) -> T | None:
    """Await `work`; if the client hangs up first, cancel it (which aborts its
    engine requests) and return None."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_seconds)
            if done:
                return task.result()
            if await is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def speculation_headers(response: GenerationResult) -> dict[str, str]:
    """The per-request speculation summary as headers, for clients that cannot
    read extra body fields."""
    summary = response.speculation
    if summary is None:
        return {}
    headers = {
        "x-specserve-speculation-applied": str(summary.applied).lower(),
        "x-specserve-draft-tokens": str(summary.draft_tokens),
        "x-specserve-accepted-tokens": str(summary.accepted_tokens),
    }
    if summary.acceptance_rate is not None:
        headers["x-specserve-acceptance-rate"] = f"{summary.acceptance_rate:.4f}"
    if summary.mean_acceptance_length is not None:
        headers["x-specserve-mean-acceptance-length"] = f"{summary.mean_acceptance_length:.4f}"
    return headers
