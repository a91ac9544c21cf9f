"""ASGI middleware bounding what request bodies can make the server hold: each
body's size (413, whether the client declares the length or streams it
chunked), how many bodies are read at once (503), and how long one may take
to arrive (408), so slow or large senders cannot pile up memory or hold the
read slots for good.

The body is read here, up to the limit, and handed on in one piece: refusing
halfway through the route's own read would surface as a parse error instead.
A request without a body (GET, probes) takes no read slot.
"""

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.replies import error_response
from server.errors import APIError, BodyReadTimeoutError, OverloadedError, PayloadTooLargeError
from server.metrics import REFUSED

# A read slot frees within --body-read-timeout-seconds at most; usually at once.
_READS_FULL_RETRY_AFTER_SECONDS = "1"


class BodyLimitsMiddleware:
    def __init__(
        self, app: ASGIApp, max_bytes: int, max_concurrent_reads: int, read_timeout_seconds: float
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_concurrent_reads = max_concurrent_reads
        self.read_timeout_seconds = read_timeout_seconds
        self.reading = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        try:
            first = await self._read(scope, receive)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        await self.app(scope, replaying([first], receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> Message:
        """The whole body as one message (or the disconnect that cut it short)."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise self._too_large()
        if self.reading >= self.max_concurrent_reads:
            REFUSED.labels("body_reads_full").inc()
            raise OverloadedError(
                f"{self.reading} request bodies are being read already, the most at once "
                "(--max-concurrent-body-reads); retry shortly",
                headers={"Retry-After": _READS_FULL_RETRY_AFTER_SECONDS},
            )
        self.reading += 1
        try:
            async with asyncio.timeout(self.read_timeout_seconds):
                return await self._read_all(receive)
        except TimeoutError:
            REFUSED.labels("body_read_timeout").inc()
            raise BodyReadTimeoutError(
                f"the request body did not arrive within {self.read_timeout_seconds:g} s "
                "(--body-read-timeout-seconds)"
            ) from None
        finally:
            self.reading -= 1

    async def _read_all(self, receive: Receive) -> Message:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client gone before sending it all
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise self._too_large()
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"request body is larger than {self.max_bytes} bytes (--max-body-bytes)"
        )


def _has_body(scope: Scope) -> bool:
    headers = dict(scope["headers"])
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


def replaying(heard: list[Message], receive: Receive) -> Receive:
    """Receive the messages already read, in order, then whatever the client sends next
    (more body, disconnects)."""

    async def replay() -> Message:
        return heard.pop(0) if heard else await receive()

    return replay
