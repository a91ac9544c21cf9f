"""API keys: who gets in, as which tenant, and what stays open."""

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from server.app import create_app
from server.auth import KeyRing, load_key_ring
from server.config import ConfigError
from tests.unit.scripted_engine import ScriptedEngine

KEYS = {"sk-alpha-0123456789": "team-a", "sk-beta-9876543210": "team-b"}
BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 2}


@pytest.fixture(params=[False, True], ids=["metrics-open", "metrics-need-key"])
async def keyed(request: pytest.FixtureRequest) -> AsyncIterator[tuple[httpx.AsyncClient, bool]]:
    app = create_app(ScriptedEngine(), api_keys=KeyRing(KEYS), metrics_need_key=request.param)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, request.param


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("sk-wrong"),
        {"Authorization": "sk-alpha-0123456789"},
        {"Authorization": "Basic sk-alpha-0123456789"},
        bearer("sk-alpha-012345678"),
    ],
)
async def test_missing_or_wrong_keys_are_401(
    keyed: tuple[httpx.AsyncClient, bool], headers: dict[str, str]
) -> None:
    client, _ = keyed
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        response = await client.request(method, path, json=BODY, headers=headers)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
        assert "sk-" not in error["message"]  # keys are never echoed


async def test_a_valid_key_is_served_as_its_tenant(
    keyed: tuple[httpx.AsyncClient, bool],
) -> None:
    client, _ = keyed
    labels = {"model": "scripted", "endpoint": "/v1/completions", "tenant": "team-b"}
    before = REGISTRY.get_sample_value("specserve_generation_tokens_total", labels) or 0.0
    response = await client.post("/v1/completions", json=BODY, headers=bearer("sk-beta-9876543210"))
    assert response.status_code == 200
    after = REGISTRY.get_sample_value("specserve_generation_tokens_total", labels)
    assert after == before + 2


async def test_health_stays_open_and_metrics_follow_the_flag(
    keyed: tuple[httpx.AsyncClient, bool],
) -> None:
    client, metrics_need_key = keyed
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == (401 if metrics_need_key else 200)
    response = await client.get("/metrics", headers=bearer("sk-alpha-0123456789"))
    assert response.status_code == 200


async def test_refusals_are_counted(keyed: tuple[httpx.AsyncClient, bool]) -> None:
    client, _ = keyed
    labels = {"endpoint": "/v1/completions", "status": "401"}
    before = REGISTRY.get_sample_value("specserve_requests_total", labels) or 0.0
    await client.post("/v1/completions", json=BODY)
    assert REGISTRY.get_sample_value("specserve_requests_total", labels) == before + 1


def test_key_file_loads_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": k, "tenant": t} for k, t in KEYS.items()]}))
    ring = load_key_ring(path)
    assert ring.tenants == {"team-a", "team-b"}
    assert ring.tenant_for("sk-alpha-0123456789") == "team-a"
    assert ring.tenant_for("sk-alpha") is None


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("not json", "must be JSON"),
        ('{"keys": []}', "no keys"),
        ('{"keys": [{"key": "a"}]}', "must be JSON"),
        ('{"keys": [{"key": "a", "tenant": "x"}, {"key": "a", "tenant": "y"}]}', "twice"),
        ('{"keys": [{"key": "", "tenant": "x"}]}', "empty"),
    ],
)
def test_bad_key_files_are_refused(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=words):
        load_key_ring(path)
