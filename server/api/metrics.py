"""GET /metrics: specserve's and vLLM's metrics in Prometheus text format, and
the middleware that keeps them on their own port.

With a metrics port, /metrics is served there only and the metrics port
serves nothing else, so exposing the API port (a public Service, a published
container port) never exposes who sends what.
"""

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.replies import error_response
from server.errors import NotFoundError

router = APIRouter()

METRICS_PATH = "/metrics"


@router.get(METRICS_PATH, include_in_schema=False)
async def metrics() -> Response:
    # One registry holds both: vLLM's stat logger registers `vllm:*` in the default one.
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


class MetricsPortMiddleware:
    """/metrics on `metrics_port` only, and nothing else there (404s in OpenAI's shape)."""

    def __init__(self, app: ASGIApp, metrics_port: int) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server")
            on_metrics_port = server is not None and server[1] == self.metrics_port
            if on_metrics_port != (scope["path"] == METRICS_PATH):
                where = "the metrics port" if on_metrics_port else "the API port"
                error = NotFoundError(f"{scope['path']} is not served on {where}")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
