"""The application factory: routers, error mapping, engine lifecycle.

`create_app(engine, ...)` builds nothing at import time; the lifespan starts the
engine before the first request and stops it on shutdown. Every error leaves
in OpenAI's shape: our own `APIError`s, request validation (400, not
FastAPI's 422), unknown routes and anything unexpected (500, logged).
"""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from server import metrics as server_metrics
from server.api import chat, completions, create_response, health, metrics, models, render
from server.api.admission import AdmissionMiddleware
from server.api.auth import ApiKeyMiddleware
from server.api.body_limit import BodyLimitsMiddleware
from server.api.instrumentation import RequestMetricsMiddleware
from server.api.metrics import MetricsPortMiddleware
from server.api.replies import CLIENT_CLOSED_REQUEST, error_response
from server.api.request_id import RequestIdMiddleware
from server.config import (
    DEFAULT_BODY_READ_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_BODY_READS,
    DEFAULT_MAX_CONCURRENT_RENDERS,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_QUEUE_TIMEOUT_SECONDS,
)
from server.engine.contract import Engine
from server.errors import (
    APIError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    error_statuses,
)
from server.protocol.limits import DEFAULT_LIMITS, RequestLimits
from server.serving import observer
from server.traffic.admission_queue import AdmissionController
from server.traffic.api_keys import ApiKeys
from server.traffic.lifecycle import Lifecycle
from server.traffic.rate_limit import RateLimiter, TenantRateLimiter
from server.traffic.rate_limit_redis import RedisRateLimiter


def _validation_error(exc: RequestValidationError) -> InvalidRequestError:
    problems = []
    param = None
    for error in exc.errors():
        # The first location item is "body"; the rest name the parameter.
        location = ".".join(str(part) for part in error.get("loc", ())[1:])
        param = param or location or None
        message = str(error.get("msg")).removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            problems.append(f"unsupported parameter: {location}")
        elif error.get("type") == "json_invalid":
            problems.append("request body is not valid JSON")
        elif location:
            problems.append(f"{location}: {message}")
        else:
            problems.append(message)
    return InvalidRequestError("; ".join(problems) or "invalid request", param=param)


def create_app(
    engine: Engine,
    *,
    baseline_tpot_seconds: float | None = None,
    api_keys: ApiKeys | None = None,
    metrics_need_key: bool = False,
    public_docs: bool = False,
    rate_limit_store: str | None = None,
    rate_limit_on_store_failure: Literal["open", "closed"] = "open",
    metrics_port: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_concurrent_body_reads: int = DEFAULT_MAX_CONCURRENT_BODY_READS,
    body_read_timeout_seconds: float = DEFAULT_BODY_READ_TIMEOUT_SECONDS,
    admission: AdmissionController | None = None,
    render_admission: AdmissionController | None = None,
    request_timeout_seconds: float | None = None,
    lifecycle: Lifecycle | None = None,
    request_limits: RequestLimits = DEFAULT_LIMITS,
) -> FastAPI:
    """The ASGI app over `engine`.

    `baseline_tpot_seconds` is the measured no-speculation time per output
    token, exported for the slower-than-baseline alert; `api_keys` None means
    open access (a reload of its file updates the tenants' rate limits too);
    `rate_limit_store` a Redis URL holding the rate limits, None this process;
    `metrics_port` None serves /metrics with the API, else on that port only (the
    process runner listens on both); `admission` (generation) and `render_admission`
    (the render routes) None mean the default bounds;
    `request_timeout_seconds` None means no deadline; `request_limits` bounds what
    one request may ask for (protocol/limits.py). The process runner shares
    `lifecycle` to drain and stop the server.
    """
    admission = admission or AdmissionController(
        DEFAULT_MAX_CONCURRENT_REQUESTS,
        DEFAULT_MAX_QUEUED_REQUESTS,
        DEFAULT_QUEUE_TIMEOUT_SECONDS,
        max_displacing=DEFAULT_MAX_CONCURRENT_REQUESTS,
    )
    renders = DEFAULT_MAX_CONCURRENT_RENDERS
    render_admission = render_admission or AdmissionController(
        renders, renders, DEFAULT_QUEUE_TIMEOUT_SECONDS
    )
    lifecycle = lifecycle or Lifecycle()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        lifecycle.loaded = True
        observer.describe_server(
            engine.info(), baseline_tpot_seconds, [*error_statuses(), CLIENT_CLOSED_REQUEST]
        )
        server_metrics.track_engine_requests(engine.unfinished_requests)
        watchdog = asyncio.create_task(lifecycle.watch_engine(engine))
        try:
            yield
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
            await engine.stop()
            await rate_limiter.close()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.lifecycle = lifecycle
    app.state.request_timeout_seconds = request_timeout_seconds
    app.state.request_limits = request_limits
    # The last added runs first: every refusal below is counted and carries
    # the request id.
    limits = api_keys.ring.limits if api_keys is not None else {}
    rate_limiter: TenantRateLimiter = (
        RateLimiter(limits)
        if rate_limit_store is None
        else RedisRateLimiter(rate_limit_store, limits, rate_limit_on_store_failure)
    )
    if api_keys is not None:
        api_keys.on_change(lambda ring: rate_limiter.set_limits(ring.limits))
    app.add_middleware(
        AdmissionMiddleware,
        lifecycle=lifecycle,
        admission=admission,
        render_admission=render_admission,
        rate_limiter=rate_limiter,
        engine=engine,
    )
    app.add_middleware(
        BodyLimitsMiddleware,
        max_bytes=max_body_bytes,
        max_concurrent_reads=max_concurrent_body_reads,
        read_timeout_seconds=body_read_timeout_seconds,
    )
    app.add_middleware(
        ApiKeyMiddleware, keys=api_keys, metrics_need_key=metrics_need_key, public_docs=public_docs
    )
    if metrics_port is not None:
        app.add_middleware(MetricsPortMiddleware, metrics_port=metrics_port)
    app.add_middleware(RequestMetricsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    for module in (completions, chat, create_response, render, models, health, metrics):
        app.include_router(module.router)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFoundError(str(exc.detail)))
        # Starlette's 405 lists the allowed methods in `Allow`; keep it.
        error = InvalidRequestError(str(exc.detail))
        return JSONResponse(error.to_body(), status_code=exc.status_code, headers=exc.headers)

    # Starlette re-raises after this handler, so uvicorn logs the traceback.
    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(InternalError("internal server error"))

    return app
