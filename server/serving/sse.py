"""Server-sent events: framing a payload, the per-choice text templates of a stream, and the
framing of a whole stream (an error after the 200 becomes an event, then [DONE]; the Responses
API: its `error` event, nothing after it).
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel

from server.errors import APIError, InternalError

logger = logging.getLogger(__name__)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_none=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_event(error: APIError) -> str:
    """An error after the stream started: a data event of OpenAI's error body."""
    return f"data: {json.dumps(error.to_body())}\n\n"


class TextEvents:
    """A stream's chunks that carry only text, from one template per choice.

    Most chunks of a stream differ only in their text. Building and dumping the
    pydantic chunk for each token is the largest share of a token's formatting, so
    each choice's chunk is dumped once, by `payload` (the function that builds the
    stream's other chunks), with `MARKER` as its text, split around it, and each
    token's text is JSON-encoded into the gap.
    """

    MARKER = "@@specserve-text@@"

    def __init__(self, payload: Callable[[int, str], BaseModel]) -> None:
        self._payload = payload  # (choice index, text) -> the chunk
        self._templates: dict[int, tuple[str, str]] = {}

    def render(self, index: int, text: str) -> str:
        template = self._templates.get(index)
        if template is None:
            event = sse(self._payload(index, self.MARKER))
            head, marker, tail = event.partition(json.dumps(self.MARKER))
            if not marker or self.MARKER in tail:
                raise ValueError("the payload must hold TextEvents.MARKER exactly once")
            template = self._templates[index] = (head, tail)
        head, tail = template
        return head + json.dumps(text, ensure_ascii=False) + tail


async def sse_stream(
    events: AsyncIterator[str],
    error_event: Callable[[APIError], str] = error_event,
    last: str | None = SSE_DONE,
) -> AsyncIterator[str]:
    """Frame a stream: an error after the 200 becomes an event (`error_event`; by
    default a data event), and the stream always ends with `last` ([DONE]; the
    Responses API sends nothing after its final event)."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield error_event(exc)
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("stream failed")
        yield error_event(InternalError("internal error while streaming"))
    if last is not None:
        yield last
