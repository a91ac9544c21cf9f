"""ASGI middleware: `Authorization: Bearer <key>` on the API routes.

Health and metrics stay open (metrics only while `metrics_need_key` is off)
so probes and scrapers need no secret. The tenant of the key, or "anonymous"
when no keys are configured, goes into the request state for metrics.
"""

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.auth import KeyRing
from server.errors import AuthenticationError
from server.metrics import ANONYMOUS_TENANT

TENANT = "specserve_tenant"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyRing | None, metrics_need_key: bool) -> None:
        self.app = app
        self.keys = keys
        self.metrics_need_key = metrics_need_key

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.metrics_need_key and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = ANONYMOUS_TENANT
        if self.keys is not None and self._protected(scope["path"]):
            found = self.keys.tenant_for(_bearer(Request(scope)))
            if found is None:
                response = AuthenticationError(
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`"
                ).to_response()
                await response(scope, receive, send)
                return
            tenant = found
        scope.setdefault("state", {})[TENANT] = tenant
        await self.app(scope, receive, send)


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def tenant(request: Request) -> str:
    return str(getattr(request.state, TENANT, ANONYMOUS_TENANT))
