"""Probes: GET /health (liveness) and GET /ready (readiness).

/health is 200 while the engine is alive and stays 200 while draining, so an
orchestrator does not kill a pod that is finishing its requests. /ready is 200
only when the models are loaded, the engine is alive and the server is not
draining: it is what takes a replica out of a load balancer. /health's body
also says what the engine runs: the model and its dtype, with the reason the
dtype was chosen, how the engine runs speculation inside vLLM (vLLM's own or
with specserve's patches, its model runner, scheduling mode and patches in
force, and why), what its processes hold against the weights and KV cache
planned, and what the speculation autopilot measured and decided last
(`details`), to key holders only when API keys are on: probes get the status, and what
the autopilot measured is shaped by every tenant's traffic.
"""

import asyncio
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.api.context import request_context
from server.api.deps import EngineDep
from server.api.replies import error_responses
from server.errors import EngineUnavailableError, ShuttingDownError
from server.traffic.lifecycle import Lifecycle

router = APIRouter()


@router.get("/health", responses=error_responses(503))
async def health(request: Request, engine: EngineDep) -> JSONResponse:
    if not await engine.check_health():
        raise EngineUnavailableError("the engine is not healthy")
    if not request_context(request).key_holder:
        return JSONResponse({"status": "ok"})
    info = engine.info()
    details = {
        "model": info.model_name,
        "dtype": info.dtype,
        "dtype_reason": info.dtype_reason,
        "engine": None if info.mode is None else asdict(info.mode),
        # Reading each process's smaps takes tens of milliseconds for a large engine: off the
        # event loop, which streams tokens meanwhile.
        "memory": await asyncio.to_thread(engine.memory),
        "autopilot": engine.autopilot_state(),
    }
    return JSONResponse({"status": "ok", "details": details})


@router.get("/ready", responses=error_responses(503))
async def ready(request: Request, engine: EngineDep) -> JSONResponse:
    lifecycle: Lifecycle = request.app.state.lifecycle
    if lifecycle.draining:
        raise ShuttingDownError("the server is draining before it stops")
    if not lifecycle.loaded:
        raise EngineUnavailableError("the models are still loading")
    if not await engine.check_health():
        raise EngineUnavailableError("the engine is not healthy")
    return JSONResponse({"status": "ready"})
