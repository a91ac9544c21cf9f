"""ASGI middleware refusing request bodies above a size limit with a 413,
whether the client declares the length or streams the body chunked.

The body is read here, up to the limit, and handed on in one piece: refusing
halfway through the route's own read would surface as a parse error instead.
"""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import PayloadTooLargeError


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        more_body = not too_large
        while more_body:
            message = await receive()
            if message["type"] != "http.request":  # client gone before sending it all
                await self.app(scope, _replay(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more_body = message.get("more_body", False)
            too_large = size > self.max_bytes
            more_body = more_body and not too_large
        if too_large:
            error = PayloadTooLargeError(f"request body is larger than {self.max_bytes} bytes")
            await error.to_response()(scope, receive, send)
            return
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay(body, receive), send)


def _replay(first: Message, receive: Receive) -> Receive:
    """Receive `first` once, then whatever the client sends next (disconnects)."""
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
