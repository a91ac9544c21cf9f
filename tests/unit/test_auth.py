"""API keys: who gets in, as which tenant, what stays open, and rotation without a restart."""

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from server.app import create_app
from server.config import ConfigError
from server.traffic.api_keys import ApiKeys, KeyRing, load_key_ring
from tests.unit.scripted_engine import ScriptedEngine

KEYS = {"sk-alpha-0123456789": "team-a", "sk-beta-9876543210": "team-b"}
BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 2}


@pytest.fixture(params=[False, True], ids=["metrics-open", "metrics-need-key"])
async def keyed(request: pytest.FixtureRequest) -> AsyncIterator[tuple[httpx.AsyncClient, bool]]:
    app = create_app(
        ScriptedEngine(), api_keys=ApiKeys(KeyRing(KEYS)), metrics_need_key=request.param
    )
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
    counted = (
        "specserve_generation_tokens_total",
        "specserve_time_to_first_token_seconds_count",
        "specserve_e2e_request_latency_seconds_count",
    )
    before = {name: REGISTRY.get_sample_value(name, labels) or 0.0 for name in counted}
    response = await client.post("/v1/completions", json=BODY, headers=bearer("sk-beta-9876543210"))
    assert response.status_code == 200
    after = {name: REGISTRY.get_sample_value(name, labels) for name in counted}
    assert after == {
        "specserve_generation_tokens_total": before["specserve_generation_tokens_total"] + 2,
        # Latency per tenant too: one request, one TTFT and one end-to-end time.
        "specserve_time_to_first_token_seconds_count": (
            before["specserve_time_to_first_token_seconds_count"] + 1
        ),
        "specserve_e2e_request_latency_seconds_count": (
            before["specserve_e2e_request_latency_seconds_count"] + 1
        ),
    }


async def test_health_stays_open_and_metrics_follow_the_flag(
    keyed: tuple[httpx.AsyncClient, bool],
) -> None:
    client, metrics_need_key = keyed
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == (401 if metrics_need_key else 200)
    response = await client.get("/metrics", headers=bearer("sk-alpha-0123456789"))
    assert response.status_code == 200


async def test_health_gives_probes_the_status_and_its_details_to_key_holders() -> None:
    engine = ScriptedEngine()
    engine.autopilot = {"k": 3, "zero_steps_by_reason": {"logit_bias": 2}}
    app = create_app(engine, api_keys=ApiKeys(KeyRing(KEYS)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for headers in ({}, bearer("sk-wrong")):
            response = await client.get("/health", headers=headers)
            assert (response.status_code, response.json()) == (200, {"status": "ok"})
        response = await client.get("/health", headers=bearer("sk-beta-9876543210"))
        assert response.status_code == 200
        assert response.json()["details"]["autopilot"] == engine.autopilot
        engine.healthy = False
        assert (await client.get("/health")).status_code == 503


async def test_without_keys_health_shows_its_details(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    engine.autopilot = {"k": 3}
    details = (await client.get("/health")).json()["details"]
    assert (details["model"], details["autopilot"]) == ("scripted", {"k": 3})


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


def _write_keys(path: Path, keys: dict[str, str]) -> None:
    path.write_text(json.dumps({"keys": [{"key": k, "tenant": t} for k, t in keys.items()]}))


async def test_a_reload_rotates_the_keys_and_a_bad_file_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.json"
    _write_keys(path, {"sk-old-key": "team-a"})
    keys = ApiKeys(load_key_ring(path), path)
    transport = httpx.ASGITransport(app=create_app(ScriptedEngine(), api_keys=keys))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def status(key: str) -> int:
            response = await client.post("/v1/completions", json=BODY, headers=bearer(key))
            return response.status_code

        assert await status("sk-old-key") == 200
        _write_keys(path, {"sk-new-key": "team-a"})
        assert keys.reload()
        assert (await status("sk-old-key"), await status("sk-new-key")) == (401, 200)
        for bad in ("not json", '{"keys": []}'):
            path.write_text(bad)
            with caplog.at_level("ERROR", logger="server.traffic.api_keys"):
                assert not keys.reload()
            assert "the previous keys stay in force" in caplog.text
            assert await status("sk-new-key") == 200
        path.unlink()
        assert not keys.reload()
        assert await status("sk-new-key") == 200


async def test_the_watch_picks_up_a_secret_style_swap_of_the_key_file(tmp_path: Path) -> None:
    """A Kubernetes Secret volume updates by pointing a symlink at a new file."""
    first, second, link = tmp_path / "v1.json", tmp_path / "v2.json", tmp_path / "keys.json"
    _write_keys(first, {"sk-first": "team-a"})
    _write_keys(second, {"sk-second": "team-b"})
    link.symlink_to(first)
    keys = ApiKeys(load_key_ring(link), link)
    watch = asyncio.create_task(keys.watch(interval_seconds=0.01))
    try:
        swapped = tmp_path / "swap"
        swapped.symlink_to(second)
        swapped.replace(link)
        # Bounded only to stop a hang: the watch acts within a few polls.
        for _ in range(1000):
            if keys.ring.tenant_for("sk-second") is not None:
                break
            await asyncio.sleep(0.01)
        assert keys.ring.tenant_for("sk-second") == "team-b"
        assert keys.ring.tenant_for("sk-first") is None
    finally:
        watch.cancel()


@pytest.mark.parametrize("path", ["/docs", "/openapi.json"])
async def test_docs_need_a_key_like_the_api_unless_public(path: str) -> None:
    for public_docs, status_without_key in ((False, 401), (True, 200)):
        app = create_app(ScriptedEngine(), api_keys=ApiKeys(KeyRing(KEYS)), public_docs=public_docs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get(path)).status_code == status_without_key
            keyed = await client.get(path, headers=bearer("sk-beta-9876543210"))
            assert keyed.status_code == 200


async def test_the_engine_is_told_each_request_s_tenant() -> None:
    """The hybrid proposer looks a request up only in its own tenant's replies."""
    engine = ScriptedEngine()
    app = create_app(engine, api_keys=ApiKeys(KeyRing(KEYS)))
    bodies = {
        "/v1/completions": BODY,
        "/v1/chat/completions": {
            "model": "scripted", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2
        },
        "/v1/responses": {"model": "scripted", "input": "a b", "max_output_tokens": 16},
    }  # fmt: skip
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for path, body in bodies.items():
            response = await client.post(path, json=body, headers=bearer("sk-alpha-0123456789"))
            assert response.status_code == 200, response.text
            assert engine.requests[-1].tenant == "team-a", path
