"""Admission control: bounded slots and queue, fast 503s, deadlines, and the
drain/readiness lifecycle, over the real app and a scripted engine."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from server.admission import AdmissionController
from server.app import create_app
from server.errors import OverloadedError
from server.lifecycle import Lifecycle
from server.logs import JsonFormatter
from tests.unit.scripted_engine import ScriptedEngine

BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 7}


async def test_slots_pass_to_waiters_in_arrival_order() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=5)
    await admission.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await admission.acquire()
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert (admission.running, admission.queued) == (1, 2)
    with pytest.raises(OverloadedError) as refused:
        await admission.acquire()  # the line is full: refused at once
    assert refused.value.status == 503
    assert int(refused.value.headers["Retry-After"]) >= 1
    admission.release(1.0)
    await asyncio.sleep(0.01)
    admission.release(1.0)
    await asyncio.gather(*waiters)
    assert order == [0, 1]
    admission.release(1.0)
    assert admission.idle


async def test_a_waiter_that_times_out_or_leaves_gives_up_its_place() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=0.05)
    await admission.acquire()
    with pytest.raises(OverloadedError, match=r"within 0\.05 s"):
        await admission.acquire()
    leaving = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    assert (admission.running, admission.queued) == (1, 0)
    admission.release(0.1)
    assert admission.idle


async def test_a_slot_handed_over_as_the_wait_is_cancelled_is_passed_on() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=5)
    await admission.acquire()
    first = asyncio.create_task(admission.acquire())
    second = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    admission.release(0.1)  # hands the slot to `first`...
    first.cancel()  # ...which is cancelled before it resumes
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, timeout=2)  # the slot reached the next waiter
    assert (admission.running, admission.queued) == (1, 0)


@pytest.fixture
async def busy_app() -> AsyncIterator[tuple[httpx.AsyncClient, AdmissionController]]:
    # Seven scripted steps of 0.1 s: each request holds its slot ~0.7 s.
    admission = AdmissionController(1, 1, queue_timeout_seconds=30)
    app = create_app(ScriptedEngine(step_delay=0.1), admission=admission)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, admission


async def test_past_the_queue_requests_get_503_and_admitted_ones_finish(
    busy_app: tuple[httpx.AsyncClient, AdmissionController],
) -> None:
    client, admission = busy_app
    stream = {**BODY, "stream": True}
    calls = [client.post("/v1/completions", json=stream if i % 2 else BODY) for i in range(4)]
    responses = await asyncio.gather(*calls)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 503, 503]
    for response in responses:
        if response.status_code == 503:
            assert response.json()["error"]["code"] == "server_overloaded"
            assert int(response.headers["retry-after"]) >= 1
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            assert response.json()["choices"][0]["text"] == "Hello world! How are you?"
    assert admission.idle


async def test_a_deadline_aborts_the_generation_with_a_clear_error() -> None:
    engine = ScriptedEngine(step_delay=0.2)
    app = create_app(engine, request_timeout_seconds=0.3)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        plain = await client.post("/v1/completions", json=BODY)
        streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert plain.status_code == 504
    assert plain.json()["error"]["code"] == "request_timeout"
    assert streamed.status_code == 200
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert events[-1] == "data: [DONE]"
    assert len(engine.aborted) == 2


async def _lifespan_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def test_ready_only_when_loaded_healthy_and_not_draining() -> None:
    engine, lifecycle = ScriptedEngine(), Lifecycle()
    app = create_app(engine, lifecycle=lifecycle)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/ready")).status_code == 503  # lifespan not run: not loaded
    async for client in _lifespan_client(app):
        assert (await client.get("/ready")).json() == {"status": "ready"}
        engine.healthy = False
        assert (await client.get("/ready")).status_code == 503
        engine.healthy = True
        lifecycle.draining = True
        ready = await client.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "server_shutting_down"
        assert (await client.get("/health")).status_code == 200  # alive while draining
        refused = await client.post("/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "5"


async def test_drain_waits_for_admitted_requests_then_asks_to_stop() -> None:
    admission, lifecycle = AdmissionController(2, 2, 5), Lifecycle()
    await admission.acquire()
    drain = asyncio.create_task(lifecycle.drain(admission, timeout_seconds=5))
    await asyncio.sleep(0.3)
    assert lifecycle.draining and not lifecycle.stop_requested.is_set()
    admission.release(0.3)
    await asyncio.wait_for(drain, timeout=2)
    assert lifecycle.stop_requested.is_set()
    assert lifecycle.exit_status == 0


async def test_drain_gives_up_at_its_timeout() -> None:
    admission, lifecycle = AdmissionController(2, 2, 5), Lifecycle()
    await admission.acquire()
    await asyncio.wait_for(lifecycle.drain(admission, timeout_seconds=0.2), timeout=2)
    assert lifecycle.stop_requested.is_set()
    assert admission.running == 1


async def test_a_dead_engine_stops_the_process_with_a_failure_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("server.lifecycle.ENGINE_CHECK_SECONDS", 0.01)
    engine, lifecycle = ScriptedEngine(), Lifecycle()
    watchdog = asyncio.create_task(lifecycle.watch_engine(engine))
    await asyncio.sleep(0.05)
    assert not lifecycle.stop_requested.is_set()
    engine.healthy = False
    await asyncio.wait_for(watchdog, timeout=2)
    assert lifecycle.stop_requested.is_set()
    assert lifecycle.exit_status == 1


def test_json_log_lines_carry_the_request_id() -> None:
    record = logging.LogRecord("server.x", logging.INFO, __file__, 1, "done %d", (3,), None)
    record.request_id = "trace-1"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "done 3"
    assert line["request_id"] == "trace-1"
    assert line["level"] == "INFO"
