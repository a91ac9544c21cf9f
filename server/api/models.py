"""Routes GET /v1/models and GET /v1/models/{model}."""

from fastapi import APIRouter

from server.api.deps import EngineDep
from server.api.replies import error_responses
from server.protocol.models import ModelCard, ModelList
from server.serving.common import check_model

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(engine: EngineDep) -> ModelList:
    info = engine.info()
    return ModelList(data=[ModelCard(id=info.model_name, created=info.created)])


@router.get(
    "/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(401, 404)
)
async def retrieve_model(model: str, engine: EngineDep) -> ModelCard:
    check_model(engine, model)
    info = engine.info()
    return ModelCard(id=info.model_name, created=info.created)
