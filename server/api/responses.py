"""How a prepared request becomes an HTTP response: JSON or an SSE stream."""

from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.protocol.chat import ChatCompletionResponse
from server.protocol.completions import CompletionResponse
from server.serving.common import sse_stream, until_disconnected

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # Starlette cancels the body iterator when the client disconnects; the
    # cancellation reaches the engine stream, which aborts its request.
    return StreamingResponse(
        sse_stream(events), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def json_unless_disconnected(
    request: Request, work: Awaitable[CompletionResponse | ChatCompletionResponse]
) -> JSONResponse:
    response = await until_disconnected(request.is_disconnected, work)
    return JSONResponse(response.model_dump(mode="json"), headers=speculation_headers(response))


def speculation_headers(response: CompletionResponse | ChatCompletionResponse) -> dict[str, str]:
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
