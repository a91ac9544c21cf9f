"""ASGI middleware counting requests by endpoint and status, and those in flight,
and stamping each request's arrival time for the latency metrics.

It wraps the whole response, streamed bodies included, so in-flight counts a
stream until its last byte. Endpoint labels come from a fixed set; any other
path is "other", so clients cannot grow the label set.
"""

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.context import context_of, request_context
from server.metrics import IN_FLIGHT, KNOWN_ENDPOINTS, REQUESTS
from server.serving.common import Caller


def endpoint_label(path: str) -> str:
    if path in KNOWN_ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class RequestMetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Before the body is read and parsed: TTFT and e2e count from here.
        context_of(scope).arrival = time.perf_counter()
        endpoint = endpoint_label(scope["path"])
        status = "500"  # if the app fails before sending anything

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        in_flight = IN_FLIGHT.labels(endpoint)
        in_flight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            in_flight.dec()
            REQUESTS.labels(endpoint, status).inc()


def arrival(request: Request) -> float:
    """`time.perf_counter()` when the middleware first saw the request."""
    return request_context(request).arrival


def caller(request: Request) -> Caller:
    """What a generation is prepared with: when the request arrived, its tenant, the priority
    the admission gave it and its deadline."""
    context = request_context(request)
    return Caller(context.arrival, context.tenant, context.priority, deadline(request))


def deadline(request: Request) -> float | None:
    """`time.perf_counter()` by which the request must be done, counted from
    arrival so that queueing uses up the same budget; None without a limit."""
    timeout: float | None = request.app.state.request_timeout_seconds
    return None if timeout is None else arrival(request) + timeout
