"""ASGI middleware in front of the generation and render routes: draining, tenant rate
limits, then admission control, in that order.

A request refused here never reaches the engine: 503 while the server drains
or is at capacity, 429 when its tenant is over its limits or has its share of
the line waiting, each with `Retry-After`. What a generation request asks for
is read once from the body the body limit already holds (`demand_of`; a body
that does not parse counts one sequence, reserves no tokens and gets its 400
from the route): it is admitted for its sequences (its prompts times `n`) and
reserves an estimate of its tokens against its tenant's tokens per minute:

- its prompts at a quarter of their UTF-8 bytes (English runs about four
  characters a token, and OpenAI estimates from characters too; nothing is
  tokenized before the route) or, for token ids, one each: a completions
  prompt (and `suffix`), a chat's `messages` and `tools`, a response's
  `input`, `instructions` and `tools`, those as compact JSON, whose syntax
  stands in for the chat template;
- plus, per sequence, its output limit as its route reads it (completions'
  `max_tokens`, 16 when absent; chat's `max_completion_tokens`, else
  `max_tokens`; responses' `max_output_tokens`) or, without one, what the
  route would allow: the model's context left after the prompt's estimate,
  which also bounds a larger limit (such a request gets its 400 anyway).

A request waiting in line watches its connection: if the client hangs up, it
leaves the line at once (499 in the metrics) and its place goes to the next. An
admitted request holds its room until its response, streamed or not, has ended,
and then its reservation is settled against the tokens it used (none if the
route refused it before generating, or the line did).

The render routes tokenize in the thread pool the generation routes prepare
in: they take their own, smaller room (`--max-concurrent-renders`, a line as
long), and count against their tenant's request rate (they reserve no tokens).
"""

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.auth import tenant
from server.api.body_limit import replaying
from server.api.context import context_of, request_context
from server.api.replies import CLIENT_CLOSED_REQUEST, error_response
from server.engine.contract import Engine
from server.errors import APIError, ShuttingDownError
from server.metrics import GENERATION_ENDPOINTS, REFUSED, RENDER_ENDPOINTS
from server.protocol.completions import CompletionRequest
from server.serving.observer import RequestObserver
from server.traffic.admission_queue import AdmissionController, Ticket
from server.traffic.lifecycle import Lifecycle
from server.traffic.rate_limit import TenantRateLimiter

# Long enough for a load balancer to stop sending us traffic.
_DRAINING_RETRY_AFTER_SECONDS = "5"

_BYTES_PER_TOKEN = 4
# The fields a chat's or a response's prompt is rendered from.
_PROMPT_FIELDS = {
    "/v1/chat/completions": ("messages", "tools"),
    "/v1/responses": ("input", "instructions", "tools"),
}
_COMPLETIONS_MAX_TOKENS = CompletionRequest.model_fields["max_tokens"].default


class AdmissionMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        lifecycle: Lifecycle,
        admission: AdmissionController,
        render_admission: AdmissionController,
        rate_limiter: TenantRateLimiter,
        engine: Engine,
    ) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.admission = admission
        self.render_admission = render_admission
        self.rate_limiter = rate_limiter
        self.engine = engine

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
        demand = (
            demand_of(path, first, self.engine.info().max_model_len)
            if admission is self.admission
            # A render call tokenizes once, whatever its n, and generates nothing.
            else Demand(sequences=1, tokens=0)
        )
        try:
            if self.lifecycle.draining:
                REFUSED.labels("shutting_down").inc()
                raise ShuttingDownError(
                    "The server is shutting down; retry on another replica",
                    headers={"Retry-After": _DRAINING_RETRY_AFTER_SECONDS},
                )
            admitted = await self.rate_limiter.admit(request_tenant, demand.tokens)
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        ticket = admission.ticket(request_tenant, demand.sequences)
        try:
            await self._serve(scope, receive, send, admission, ticket, first, admitted.headers)
        finally:
            observer = context_of(scope).observer
            used = 0 if observer is None else observer.prompt_tokens + observer.output_tokens
            if used != admitted.reserved_tokens:
                await self.rate_limiter.settle(request_tenant, admitted.reserved_tokens, used)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        admission: AdmissionController,
        ticket: Ticket,
        first: Message,
        limit_headers: dict[str, str],
    ) -> None:
        """Take the ticket's room, then run the app in it, its response with `limit_headers`."""
        try:
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


@dataclass(frozen=True)
class Demand:
    """What a request asks of admission."""

    sequences: int  # the engine's room it takes: its prompts times n
    tokens: int  # the estimate it reserves of its tenant's tokens per minute


def demand_of(path: str, message: Message, max_model_len: int) -> Demand:
    """What a generation body asks for (the module's docstring says how its tokens are
    estimated); one sequence and no tokens for a body that does not parse, which the route
    refuses."""
    try:
        body = json.loads(message.get("body", b""))
    except ValueError:
        return Demand(sequences=1, tokens=0)
    if not isinstance(body, dict):
        return Demand(sequences=1, tokens=0)
    choices = _count(body.get("n")) or 1
    limit = _output_limit(path, body)
    tokens = 0
    prompts = _prompt_estimates(path, body)
    for prompt in prompts:
        room = max(max_model_len - prompt, 0)
        tokens += prompt + choices * (room if limit is None else min(limit, room))
    return Demand(sequences=choices * len(prompts), tokens=tokens)


def _count(value: Any) -> int | None:
    """`value` if it is a positive integer (else the route refuses it), otherwise None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _prompt_estimates(path: str, body: dict[str, Any]) -> list[int]:
    """The estimated tokens of each prompt (several only in completions: a list of strings
    or of token lists)."""
    if path != "/v1/completions":
        return [sum(_text_estimate(body.get(field)) for field in _PROMPT_FIELDS[path])]
    prompt, suffix = body.get("prompt"), _text_estimate(body.get("suffix"))
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return [_completion_prompt_estimate(each) + suffix for each in prompt]
    return [_completion_prompt_estimate(prompt) + suffix]


def _completion_prompt_estimate(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, list) else _text_estimate(prompt)


def _text_estimate(value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return math.ceil(len(value.encode()) / _BYTES_PER_TOKEN)


def _output_limit(path: str, body: dict[str, Any]) -> int | None:
    """The tokens each sequence may generate, as its route reads them; None for as many as
    the context allows."""
    if path == "/v1/completions":
        limit = body.get("max_tokens", _COMPLETIONS_MAX_TOKENS)
    elif path == "/v1/chat/completions":
        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
    else:
        limit = body.get("max_output_tokens")
    return _count(limit)


def record_usage(request: Request, observer: RequestObserver) -> None:
    """Let the middleware settle this request's tokens once it ends."""
    request_context(request).observer = observer
