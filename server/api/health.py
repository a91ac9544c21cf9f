"""Route GET /health: 200 while the engine is alive, 503 otherwise."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.api.deps import EngineDep
from server.errors import EngineUnavailableError

router = APIRouter()


@router.get("/health")
async def health(engine: EngineDep) -> JSONResponse:
    if not await engine.check_health():
        raise EngineUnavailableError("the engine is not healthy")
    return JSONResponse({"status": "ok"})
