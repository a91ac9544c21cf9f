"""What the middlewares learn about a request, typed, for the layers after them.

One `RequestContext` per HTTP request, kept in the ASGI scope under specserve's own key (not
Starlette's untyped `scope["state"]`): the outermost middleware that needs it creates it, the
others and the routes read it with `context_of(scope)` or `request_context(request)`.
"""

import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import Scope

from server.metrics import ANONYMOUS_TENANT
from server.serving.observer import RequestObserver

_SCOPE_KEY = "specserve.context"


@dataclass
class RequestContext:
    # `time.perf_counter()` when the request arrived, before its body was read: TTFT and
    # end-to-end latency count from here, and its deadline too.
    arrival: float = field(default_factory=time.perf_counter)
    tenant: str = ANONYMOUS_TENANT  # the API key's tenant, set by the auth middleware
    # Keys are off, or the request presented a valid one (set by the auth middleware): what
    # open routes show beyond their status is for key holders.
    key_holder: bool = False
    # The engine's scheduling priority (smaller goes first), set by the admission middleware:
    # the sequences the request's tenant held when it was admitted (admission_queue.py).
    priority: int = 0
    # The generation's token accounting, once a route has one; the admission middleware
    # settles its tokens against the tenant's rate limit when the request ends.
    observer: RequestObserver | None = None


def context_of(scope: Scope) -> RequestContext:
    """The request's context, created on first use (arrival is then)."""
    context = scope.get(_SCOPE_KEY)
    if context is None:
        context = scope[_SCOPE_KEY] = RequestContext()
    assert isinstance(context, RequestContext)
    return context


def request_context(request: Request) -> RequestContext:
    return context_of(request.scope)
