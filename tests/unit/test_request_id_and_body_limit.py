"""X-Request-Id on responses and log lines; the request body size limit."""

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from server.api.request_id import RequestIdLogFilter
from server.app import create_app
from tests.unit.scripted_engine import ScriptedEngine

BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 2}


async def test_a_request_id_is_generated_for_every_response(client: httpx.AsyncClient) -> None:
    ok = await client.post("/v1/completions", json=BODY)
    refused = await client.post("/v1/completions", json={**BODY, "n": 0})
    ids = [r.headers["x-request-id"] for r in (ok, refused)]
    assert all(len(i) == 32 for i in ids) and ids[0] != ids[1]


@pytest.mark.parametrize(
    ("given", "kept"),
    [("req-42.a:b_c", True), ("x" * 129, False), ("bad id\\n", False), ("", False)],
)
async def test_client_request_ids_are_kept_if_plain(
    client: httpx.AsyncClient, given: str, kept: bool
) -> None:
    response = await client.get("/health", headers={"X-Request-Id": given})
    assert (response.headers["x-request-id"] == given) is kept


async def test_log_lines_carry_the_request_id(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RequestIdLogFilter())
    with caplog.at_level(logging.INFO, logger="server"):
        await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "trace-7"})
    finished = [r for r in caplog.records if "output tokens" in r.getMessage()]
    assert [r.request_id for r in finished] == ["trace-7"]  # type: ignore[attr-defined]


@pytest.fixture
async def small(engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine, max_body_bytes=2048))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def test_declared_oversized_body_is_413(small: httpx.AsyncClient) -> None:
    response = await small.post("/v1/completions", json={**BODY, "prompt": "w " * 2000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


async def test_streamed_oversized_body_is_413(small: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "scripted", "prompt": "'
        for _ in range(100):
            yield b"w " * 50
        yield b'"}'

    response = await small.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413


async def test_bodies_under_the_limit_pass(small: httpx.AsyncClient) -> None:
    assert (await small.post("/v1/completions", json=BODY)).status_code == 200


def _held_body(sent: asyncio.Event, release: asyncio.Event) -> AsyncIterator[bytes]:
    """A completions body whose last part waits for `release` (sent: the first part is out)."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "scripted", "prompt": "a b",'
        sent.set()
        await release.wait()
        yield b' "max_tokens": 2}'

    return chunks()


async def test_bodies_past_the_concurrent_read_limit_get_503_and_bodiless_requests_pass(
    engine: ScriptedEngine,
) -> None:
    app = create_app(engine, max_concurrent_body_reads=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        sent, release = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(
            client.post(
                "/v1/completions",
                content=_held_body(sent, release),
                headers={"content-type": "application/json"},
            )
        )
        await sent.wait()
        refused = await client.post("/v1/completions", json=BODY)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert "--max-concurrent-body-reads" in refused.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200
        release.set()
        assert (await slow).status_code == 200
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200


async def test_a_body_that_does_not_arrive_in_time_gets_408(engine: ScriptedEngine) -> None:
    app = create_app(engine, body_read_timeout_seconds=0.05)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        never = asyncio.Event()
        response = await client.post(
            "/v1/completions",
            content=_held_body(asyncio.Event(), never),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 408
        error = response.json()["error"]
        assert error["code"] == "request_body_timeout"
        assert "--body-read-timeout-seconds" in error["message"]
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
