"""GET /v1/models, GET /health."""

import httpx

from tests.unit.scripted_engine import ScriptedEngine


async def test_models_lists_the_served_model(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["scripted"]
    assert body["data"][0]["object"] == "model"
    assert (await client.get("/v1/models/scripted")).json()["id"] == "scripted"


async def test_health_follows_the_engine(client: httpx.AsyncClient, engine: ScriptedEngine) -> None:
    assert (await client.get("/health")).status_code == 200
    engine.healthy = False
    response = await client.get("/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
