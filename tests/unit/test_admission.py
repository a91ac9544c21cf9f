"""Admission control: bounded slots and queue, fast 503s, deadlines, and the
drain/readiness lifecycle, over the real app and a scripted engine."""

import asyncio
import json
import logging
import logging.config
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from server.api.admission import AdmissionMiddleware
from server.app import create_app
from server.errors import OverloadedError
from server.logs import JsonFormatter, configure_logging
from server.traffic.admission_queue import AdmissionController
from server.traffic.lifecycle import Lifecycle
from server.traffic.rate_limit import RateLimiter
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
    assert "--max-queued-requests" in refused.value.message
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
    with pytest.raises(OverloadedError, match=r"within 0\.05 s \(--queue-timeout-seconds\)"):
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
    monkeypatch.setattr("server.traffic.lifecycle.ENGINE_CHECK_SECONDS", 0.01)
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


def test_json_logging_points_vllm_s_loggers_at_the_same_json_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("json")
    finally:
        root.handlers[:], root.level = saved
        logging.captureWarnings(False)
    config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
    # Applied as vLLM applies it in each of its processes, to a stand-in logger name.
    config["loggers"] = {"vllm-stand-in": config["loggers"]["vllm"]}
    logging.config.dictConfig(config)
    logging.getLogger("vllm-stand-in").info("engine %s", "ready")
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line) | {"time": "-"} == {
        "time": "-", "level": "INFO", "logger": "vllm-stand-in", "request_id": "-",
        "message": "engine ready",
    }  # fmt: skip


class _Client:
    """One request's side of ASGI: sends its body, then hangs up when told to."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.hang_up = asyncio.Event()
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        if self.body:
            body, self.body = self.body, b""
            return {"type": "http.request", "body": body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(10_000):  # bounded only to stop a hang
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def test_a_queued_request_whose_client_hangs_up_leaves_the_line_at_once() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=30)
    finish = asyncio.Event()
    bodies: list[bytes] = []

    async def engine_route(scope: Scope, receive: Receive, send: Send) -> None:
        bodies.append((await receive())["body"])
        await finish.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    app = AdmissionMiddleware(engine_route, Lifecycle(), admission, RateLimiter({}))

    def call(client: _Client) -> "asyncio.Task[None]":
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        return asyncio.create_task(app({**scope, "state": {}}, client.receive, client.send))

    running, leaving, next_in_line = _Client(b"first"), _Client(b"second"), _Client(b"third")
    calls = [call(running)]
    await _until(lambda: admission.running == 1)
    calls += [call(leaving), call(next_in_line)]
    await _until(lambda: admission.queued == 2)
    leaving.hang_up.set()
    await calls[1]
    assert leaving.status == 499
    assert (admission.running, admission.queued) == (1, 1)
    finish.set()
    await asyncio.gather(calls[0], calls[2])
    # The next in line got the slot, and its body, read while it waited, reached the route.
    assert (running.status, next_in_line.status) == (200, 200)
    assert bodies == [b"first", b"third"]
    assert admission.idle
