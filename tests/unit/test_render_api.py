"""POST /v1/{chat/completions,completions,responses}/render over the scripted engine: the
prompt token ids the generation route would use, validated the same way, nothing generated;
and the fields vllm-router adds to the bodies it forwards."""

import httpx
import pytest

from server.protocol.common import ROUTER_DEFAULT_FIELDS
from tests.unit.scripted_engine import ScriptedEngine

USER = [{"role": "user", "content": "hi"}]


async def test_chat_render_gives_the_prompt_the_generation_uses(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    body = {"model": "scripted", "messages": USER, "max_tokens": 2}
    rendered = await client.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200
    assert engine.requests == []  # nothing generated
    await client.post("/v1/chat/completions", json=body)
    assert rendered.json() == {"token_ids": engine.requests[0].prompt_token_ids}


async def test_completion_render_gives_one_prompt_per_prompt(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    body = {"model": "scripted", "prompt": ["a b", "c"], "max_tokens": 1}
    rendered = (await client.post("/v1/completions/render", json=body)).json()
    await client.post("/v1/completions", json=body)
    assert rendered == [{"token_ids": r.prompt_token_ids} for r in engine.requests]
    assert len(rendered) == 2


async def test_responses_render_gives_the_prompt_the_generation_uses(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    body = {"model": "scripted", "input": "hi there", "max_output_tokens": 2}
    rendered = (await client.post("/v1/responses/render", json=body)).json()
    await client.post("/v1/responses", json=body)
    assert rendered == {"token_ids": engine.requests[0].prompt_token_ids}


async def test_render_refuses_what_the_generation_refuses(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions/render", json={"model": "other", "messages": USER}
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_the_router_s_added_fields_pass_at_their_defaults_only(
    client: httpx.AsyncClient, path: str
) -> None:
    body: dict[str, object] = {"model": "scripted", "max_tokens": 1}
    body.update({"messages": USER} if "chat" in path else {"prompt": "a"})
    accepted = await client.post(path, json={**body, **ROUTER_DEFAULT_FIELDS})
    assert accepted.status_code == 200
    for name, default in ROUTER_DEFAULT_FIELDS.items():
        refused = await client.post(path, json={**body, name: not default})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == name
