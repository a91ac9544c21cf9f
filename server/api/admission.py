"""ASGI middleware in front of the generation and render routes: draining, tenant rate
limits, then admission control, in that order.

A request refused here never reaches the engine: 503 while the server drains
or is at capacity, 429 when its tenant is over its limits or has its share of
the line waiting, each with `Retry-After`. A generation request is admitted for
its sequences (its prompts times `n`, read from the body the body limit already
holds; a body that does not parse counts one and gets its 400 from the route).
A request waiting in line watches its connection: if the client hangs up, it
leaves the line at once (499 in the metrics) and its place goes to the next. An
admitted request holds its room until its response, streamed or not, has ended,
and then its tokens are charged to its tenant.

The render routes tokenize in the thread pool the generation routes prepare
in: they take their own, smaller room (`--max-concurrent-renders`, a line as
long), and count against their tenant's request rate.
"""

import asyncio
import json
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
from server.metrics import GENERATION_ENDPOINTS, REFUSED, RENDER_ENDPOINTS
from server.serving.observer import RequestObserver
from server.traffic.admission_queue import AdmissionController, Ticket
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
        render_admission: AdmissionController,
        rate_limiter: TenantRateLimiter,
    ) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.admission = admission
        self.render_admission = render_admission
        self.rate_limiter = rate_limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if path in GENERATION_ENDPOINTS:
            admission = self.admission
        elif path in RENDER_ENDPOINTS:
            admission = self.render_admission
        else:
            await self.app(scope, receive, send)
            return
        request_tenant = tenant(Request(scope))
        first = await receive()  # the whole body: the body limit hands it on in one message
        try:
            if self.lifecycle.draining:
                REFUSED.labels("shutting_down").inc()
                raise ShuttingDownError(
                    "The server is shutting down; retry on another replica",
                    headers={"Retry-After": _DRAINING_RETRY_AFTER_SECONDS},
                )
            limit_headers = await self.rate_limiter.admit(request_tenant)
            # A render call tokenizes once, whatever its n.
            sequences = sequences_of(path, first) if admission is self.admission else 1
            ticket = admission.ticket(request_tenant, sequences)
            admitted = await self._take_room(admission, ticket, first, receive)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if admitted is None:
            REFUSED.labels("client_disconnected").inc()
            await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
            return
        admitted_receive, context_of(scope).priority = admitted

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(limit_headers)
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, admitted_receive, send_with_limits)
        finally:
            admission.release(ticket, time.perf_counter() - started)
            observer = context_of(scope).observer
            if observer is not None:
                tokens = observer.prompt_tokens + observer.output_tokens
                await self.rate_limiter.charge_tokens(request_tenant, tokens)

    async def _take_room(
        self, admission: AdmissionController, ticket: Ticket, first: Message, receive: Receive
    ) -> tuple[Receive, int] | None:
        """Take the ticket's room, watching the connection while in line for it. Returns what
        the app receives from (the messages read so far, then the client's) and the engine
        priority, or None when the client hung up first; raises the admission's refusals."""
        heard = [first]
        priority = admission.try_acquire(ticket)
        if priority is not None:
            return replaying(heard, receive), priority
        if first["type"] == "http.disconnect":
            return None

        async def until_hung_up() -> None:
            while True:
                heard.append(await receive())
                if heard[-1]["type"] == "http.disconnect":
                    return

        waiting = asyncio.ensure_future(admission.acquire(ticket))
        watching = asyncio.ensure_future(until_hung_up())
        try:
            await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Leaving the line gives the place (or room handed over meanwhile) to the next.
            if not waiting.done():
                waiting.cancel()
            watching.cancel()
            await asyncio.gather(waiting, watching, return_exceptions=True)
        if waiting.cancelled():
            return None
        # A refusal (line full, queue timeout, tenant's share) raises here.
        return replaying(heard, receive), waiting.result()


def sequences_of(path: str, message: Message) -> int:
    """How many sequences a body asks the engine for: its `n` times its prompts (several
    only in completions: a list of strings or of token lists). One for a body that does not
    parse; the route refuses it."""
    try:
        body = json.loads(message.get("body", b""))
    except ValueError:
        return 1
    if not isinstance(body, dict):
        return 1
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    if path != "/v1/completions" or not isinstance(prompt, list) or not prompt:
        return choices
    return choices * (1 if isinstance(prompt[0], int) else len(prompt))


def record_usage(request: Request, observer: RequestObserver) -> None:
    """Let the middleware charge this request's tokens once it ends."""
    request_context(request).observer = observer
