"""Routes GET /v1/models and GET /v1/models/{model}."""

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel

from server.api.deps import EngineDep
from server.serving.common import check_model

router = APIRouter()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@router.get("/v1/models", response_model=ModelList)
async def list_models(engine: EngineDep) -> ModelList:
    info = engine.info()
    return ModelList(data=[ModelCard(id=info.model_name, created=info.created)])


@router.get("/v1/models/{model:path}", response_model=ModelCard)
async def retrieve_model(model: str, engine: EngineDep) -> ModelCard:
    check_model(engine, model)
    info = engine.info()
    return ModelCard(id=info.model_name, created=info.created)
