"""ASGI middleware: `Authorization: Bearer <key>` on the API routes.

Health and metrics stay open (metrics only while `metrics_need_key` is off)
so probes and scrapers need no secret; on an open path a valid key still
counts, and only its holder sees /health's details (`key_holder` in the
context). The API's documentation (/docs, /openapi.json) needs a key like the
API unless `public_docs`. The tenant of the key, or "anonymous" when no keys
are configured or none was needed, goes into the request's context
(context.py) for metrics and rate limits.
"""

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.context import context_of, request_context
from server.api.replies import error_response
from server.errors import AuthenticationError
from server.traffic.api_keys import ApiKeys

# FastAPI's interactive documentation and the schema it reads.
DOCS_PATHS = {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}


class ApiKeyMiddleware:
    def __init__(
        self, app: ASGIApp, keys: ApiKeys | None, metrics_need_key: bool, public_docs: bool
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics_need_key = metrics_need_key
        self.public_docs = public_docs

    def _protected(self, path: str) -> bool:
        return (
            path.startswith("/v1/")
            or (self.metrics_need_key and path == "/metrics")
            or (not self.public_docs and path in DOCS_PATHS)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = context_of(scope)
        if self.keys is None:
            context.key_holder = True
        else:
            found = self.keys.ring.tenant_for(_bearer(Request(scope)))
            if found is None and self._protected(scope["path"]):
                response = error_response(
                    AuthenticationError(
                        "Incorrect or missing API key: send `Authorization: Bearer <key>`"
                    )
                )
                await response(scope, receive, send)
                return
            if found is not None:
                context.tenant, context.key_holder = found, True
        await self.app(scope, receive, send)


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def tenant(request: Request) -> str:
    return request_context(request).tenant
