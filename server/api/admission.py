"""ASGI middleware in front of the generation routes: draining, tenant rate
limits, then admission control, in that order.

A request refused here never reaches the engine: 503 while the server drains
or is at capacity, 429 when its tenant is over its limits, each with
`Retry-After`. A request waiting in line for a slot watches its connection:
if the client hangs up, it leaves the line at once (499 in the metrics) and
its place goes to the next. An admitted request holds its engine slot until
its response, streamed or not, has ended, and then its tokens are charged to
its tenant.
"""

import asyncio
import time

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.auth import tenant
from server.api.body_limit import replaying
from server.api.context import context_of, request_context
from server.api.replies import CLIENT_CLOSED_REQUEST, error_response
from server.errors import APIError, ShuttingDownError
from server.metrics import GENERATION_ENDPOINTS, REFUSED
from server.serving.observer import RequestObserver
from server.traffic.admission_queue import AdmissionController
from server.traffic.lifecycle import Lifecycle
from server.traffic.rate_limit import TenantRateLimiter

# Long enough for a load balancer to stop sending us traffic.
_DRAINING_RETRY_AFTER_SECONDS = "5"


class AdmissionMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        lifecycle: Lifecycle,
        admission: AdmissionController,
        rate_limiter: TenantRateLimiter,
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
            limit_headers = await self.rate_limiter.admit(request_tenant)
            admitted_receive = await self._take_slot(receive)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if admitted_receive is None:
            REFUSED.labels("client_disconnected").inc()
            await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(limit_headers)
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, admitted_receive, send_with_limits)
        finally:
            self.admission.release(time.perf_counter() - started)
            observer = context_of(scope).observer
            if observer is not None:
                tokens = observer.prompt_tokens + observer.output_tokens
                await self.rate_limiter.charge_tokens(request_tenant, tokens)

    async def _take_slot(self, receive: Receive) -> Receive | None:
        """Take an engine slot, watching the connection while in line for one. Returns what
        the app receives from (the messages read while waiting, then the client's), or None
        when the client hung up first; raises the admission's refusals."""
        if self.admission.try_acquire():
            return receive
        heard: list[Message] = []

        async def until_hung_up() -> None:
            while True:
                heard.append(await receive())
                if heard[-1]["type"] == "http.disconnect":
                    return

        waiting = asyncio.ensure_future(self.admission.acquire())
        watching = asyncio.ensure_future(until_hung_up())
        try:
            await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Leaving the line gives the place (or a slot handed over meanwhile) to the next.
            if not waiting.done():
                waiting.cancel()
            watching.cancel()
            await asyncio.gather(waiting, watching, return_exceptions=True)
        if waiting.cancelled():
            return None
        waiting.result()  # a refusal (line full, queue timeout) raises here
        return replaying(heard, receive)


def record_usage(request: Request, observer: RequestObserver) -> None:
    """Let the middleware charge this request's tokens once it ends."""
    request_context(request).observer = observer
