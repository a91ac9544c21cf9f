"""ASGI middleware in front of the generation routes: draining, tenant rate
limits, then admission control, in that order.

A request refused here never reaches the engine: 503 while the server drains
or is at capacity, 429 when its tenant is over its limits, each with
`Retry-After`. An admitted request holds its engine slot until its response,
streamed or not, has ended, and then its tokens are charged to its tenant.
"""

import time

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.admission import AdmissionController
from server.api.auth import tenant
from server.errors import APIError, ShuttingDownError
from server.lifecycle import Lifecycle
from server.metrics import GENERATION_ENDPOINTS, REFUSED, RequestObserver
from server.rate_limit import RateLimiter

_OBSERVER = "specserve_observer"
# Long enough for a load balancer to stop sending us traffic.
_DRAINING_RETRY_AFTER_SECONDS = "5"


class AdmissionMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        lifecycle: Lifecycle,
        admission: AdmissionController,
        rate_limiter: RateLimiter,
    ) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.admission = admission
        self.rate_limiter = rate_limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_ENDPOINTS
        ):
            await self.app(scope, receive, send)
            return
        request_tenant = tenant(Request(scope))
        try:
            if self.lifecycle.draining:
                REFUSED.labels("shutting_down").inc()
                raise ShuttingDownError(
                    "The server is shutting down; retry on another replica",
                    headers={"Retry-After": _DRAINING_RETRY_AFTER_SECONDS},
                )
            limit_headers = self.rate_limiter.admit(request_tenant)
            await self.admission.acquire()
        except APIError as exc:
            await exc.to_response()(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(limit_headers)
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            self.admission.release(time.perf_counter() - started)
            observer: RequestObserver | None = scope.get("state", {}).get(_OBSERVER)
            if observer is not None:
                tokens = observer.prompt_tokens + observer.output_tokens
                self.rate_limiter.charge_tokens(request_tenant, tokens)


def record_usage(request: Request, observer: RequestObserver) -> None:
    """Let the middleware charge this request's tokens once it ends."""
    setattr(request.state, _OBSERVER, observer)
