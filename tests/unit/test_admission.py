"""Admission control: bounded slots and queue, fast 503s, deadlines, tokens reserved
against a tenant's limit, and the drain/readiness lifecycle, over the real app and a
scripted engine."""

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

from server.api.admission import AdmissionMiddleware, Demand, demand_of
from server.app import create_app
from server.errors import OverloadedError
from server.logs import JsonFormatter, configure_logging
from server.metrics import ANONYMOUS_TENANT
from server.traffic.admission_queue import AdmissionController, Ticket
from server.traffic.lifecycle import Lifecycle
from server.traffic.rate_limit import RateLimiter, TenantLimits
from tests.unit.scripted_engine import ScriptedEngine

BODY = {"model": "scripted", "prompt": "a b", "max_tokens": 7}
ONE = Ticket("anonymous", 1)  # one sequence of a server without keys


async def test_slots_pass_to_waiters_in_arrival_order() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=5)
    await admission.acquire(ONE)
    order: list[int] = []

    async def wait(i: int) -> None:
        await admission.acquire(ONE)
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert (admission.running, admission.queued) == (1, 2)
    with pytest.raises(OverloadedError) as refused:
        await admission.acquire(ONE)  # the line is full: refused at once
    assert refused.value.status == 503
    assert "--max-queued-requests" in refused.value.message
    assert int(refused.value.headers["Retry-After"]) >= 1
    admission.release(ONE, 1.0)
    await asyncio.sleep(0.01)
    admission.release(ONE, 1.0)
    await asyncio.gather(*waiters)
    assert order == [0, 1]
    admission.release(ONE, 1.0)
    assert admission.idle


async def test_a_waiter_that_times_out_or_leaves_gives_up_its_place() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=0.05)
    await admission.acquire(ONE)
    with pytest.raises(OverloadedError, match=r"within 0\.05 s \(--queue-timeout-seconds\)"):
        await admission.acquire(ONE)
    leaving = asyncio.create_task(admission.acquire(ONE))
    await asyncio.sleep(0.01)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    assert (admission.running, admission.queued) == (1, 0)
    admission.release(ONE, 0.1)
    assert admission.idle


async def test_a_slot_handed_over_as_the_wait_is_cancelled_is_passed_on() -> None:
    admission = AdmissionController(1, 2, queue_timeout_seconds=5)
    await admission.acquire(ONE)
    first = asyncio.create_task(admission.acquire(ONE))
    second = asyncio.create_task(admission.acquire(ONE))
    await asyncio.sleep(0.01)
    admission.release(ONE, 0.1)  # hands the slot to `first`...
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
    await admission.acquire(ONE)
    drain = asyncio.create_task(lifecycle.drain(admission, timeout_seconds=5))
    await asyncio.sleep(0.3)
    assert lifecycle.draining and not lifecycle.stop_requested.is_set()
    admission.release(ONE, 0.3)
    await asyncio.wait_for(drain, timeout=2)
    assert lifecycle.stop_requested.is_set()
    assert lifecycle.exit_status == 0


async def test_drain_gives_up_at_its_timeout() -> None:
    admission, lifecycle = AdmissionController(2, 2, 5), Lifecycle()
    await admission.acquire(ONE)
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

    renders = AdmissionController(1, 1, queue_timeout_seconds=30)
    app = AdmissionMiddleware(
        engine_route, Lifecycle(), admission, renders, RateLimiter({}), ScriptedEngine()
    )

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


async def test_freed_room_goes_to_the_waiting_tenant_holding_the_least() -> None:
    admission = AdmissionController(2, 8, queue_timeout_seconds=5)
    flood, light = admission.ticket("a", 1), admission.ticket("b", 1)
    for _ in range(2):
        await admission.acquire(flood)
    order: list[str] = []

    async def wait(ticket: Ticket) -> None:
        await admission.acquire(ticket)
        order.append(ticket.tenant)

    # a's two more arrive first, then b's: b holds nothing, so b goes first.
    waiters = [asyncio.create_task(wait(t)) for t in (flood, flood)]
    await _until(lambda: admission.queued == 2)
    waiters.append(asyncio.create_task(wait(light)))
    await _until(lambda: admission.queued == 3)
    admission.release(flood, 1.0)
    await _until(lambda: len(order) == 1)
    assert order == ["b"] and admission.held_by("b") == 1
    # Now a holds 1 and b 1: the rest is a's, in arrival order.
    admission.release(flood, 1.0)
    admission.release(light, 1.0)
    await asyncio.gather(*waiters)
    assert order == ["b", "a", "a"]
    for _ in range(2):
        admission.release(flood, 1.0)
    assert admission.idle


async def test_room_is_counted_in_sequences_and_a_wide_head_is_not_passed() -> None:
    admission = AdmissionController(4, 16, queue_timeout_seconds=5)
    assert admission.ticket("a", 64).sequences == 4  # wider than the engine: all of it
    assert admission.ticket("a", 0).sequences == 1
    wide, narrow = admission.ticket("a", 4), admission.ticket("b", 1)
    await admission.acquire(narrow)
    assert not admission.try_acquire(wide)
    waiting_wide = asyncio.create_task(admission.acquire(wide))
    await _until(lambda: admission.queued == 4)
    # b holds 1, a nothing: a's wide head is next, and b's later request waits behind it.
    waiting_narrow = asyncio.create_task(admission.acquire(narrow))
    await _until(lambda: admission.queued == 5)
    admission.release(narrow, 1.0)
    await waiting_wide
    assert (admission.running, admission.held_by("a"), admission.queued) == (4, 4, 1)
    admission.release(wide, 1.0)
    await waiting_narrow
    admission.release(narrow, 1.0)
    assert admission.idle


async def test_a_key_with_its_share_of_the_line_waiting_gets_429_others_still_queue() -> None:
    from server.errors import RateLimitError

    admission = AdmissionController(1, 4, queue_timeout_seconds=5)
    assert admission.max_queued_per_tenant == 2  # half the line unless set
    await admission.acquire(admission.ticket("a", 1))
    flood = [asyncio.create_task(admission.acquire(admission.ticket("a", 1))) for _ in range(2)]
    await _until(lambda: admission.queued == 2)
    with pytest.raises(RateLimitError) as refused:
        await admission.acquire(admission.ticket("a", 1))
    assert refused.value.status == 429 and refused.value.type == "requests"
    assert "--max-queued-per-tenant 2" in refused.value.message
    assert int(refused.value.headers["Retry-After"]) >= 1
    light = asyncio.create_task(admission.acquire(admission.ticket("b", 1)))
    await _until(lambda: admission.queued == 3)  # b still queues, and goes first
    admission.release(admission.ticket("a", 1), 1.0)
    await light
    assert admission.held_by("b") == 1
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)


async def test_without_keys_the_shared_line_is_the_only_bound() -> None:
    admission = AdmissionController(1, 4, queue_timeout_seconds=5)
    await admission.acquire(ONE)
    waiting = [asyncio.create_task(admission.acquire(ONE)) for _ in range(4)]
    await _until(lambda: admission.queued == 4)
    with pytest.raises(OverloadedError):
        await admission.acquire(ONE)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


# The chat message below as compact JSON, `[{"role":"user","content":"hi"}]`: 32 bytes.
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "sequences", "tokens"),
    [
        # Three one-token prompts, each with four choices of completions' default 16 tokens.
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 4}, 12, 3 * (1 + 4 * 16)),
        # Token ids count one each.
        ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 5}, 4, 2 + 1 + 4 * 5),
        # One tokenized prompt; max_tokens null: what the context leaves (64 tokens here).
        ("/v1/completions", {"prompt": [1, 2, 3], "n": 2, "max_tokens": None}, 2, 3 + 2 * 61),
        ("/v1/completions", {"prompt": "a", "n": True}, 1, 1 + 16),
        # Bytes, not characters: 9 for these three.
        ("/v1/completions", {"prompt": "日本語", "max_tokens": 1}, 1, 3 + 1),
        # A limit beyond the context reserves what the context leaves.
        ("/v1/completions", {"prompt": "abcdefgh", "suffix": "ijkl", "max_tokens": 100}, 1, 64),
        ("/v1/chat/completions", {"messages": HI, "n": 4, "max_tokens": 3}, 4, 8 + 4 * 3),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_tokens": 3, "max_completion_tokens": 5},
            1,
            8 + 5,
        ),
        ("/v1/chat/completions", {"messages": HI, "n": 2}, 2, 8 + 2 * (64 - 8)),
        ("/v1/chat/completions", {"messages": HI, "prompt": ["a", "b"]}, 1, 64),
        (
            "/v1/responses",
            {"input": "abcdefgh", "instructions": "be brief", "max_output_tokens": 10},
            1,
            2 + 2 + 10,
        ),
        ("/v1/responses", {"input": "a", "n": 3}, 3, 1 + 3 * 63),  # its route refuses n
        ("/v1/completions", None, 1, 0),  # not JSON: the route answers 400
    ],
)
def test_a_request_asks_for_its_prompts_times_n_and_reserves_its_tokens(
    path: str, body: dict[str, object] | None, sequences: int, tokens: int
) -> None:
    raw = json.dumps(body).encode() if body is not None else b"{not json"
    demand = demand_of(path, {"type": "http.request", "body": raw}, max_model_len=64)
    assert demand == Demand(sequences, tokens)


def _header(client: "_Client", name: bytes) -> str:
    (start,) = [m for m in client.sent if m["type"] == "http.response.start"]
    return dict(start["headers"])[name].decode()


async def test_concurrent_requests_cannot_overdraw_their_tenant_s_tokens() -> None:
    finish = asyncio.Event()

    async def engine_route(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await finish.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    admission = AdmissionController(4, 4, queue_timeout_seconds=30)
    renders = AdmissionController(1, 1, queue_timeout_seconds=30)
    # A stopped clock: the bucket does not refill while the test runs, however slowly.
    limiter = RateLimiter({ANONYMOUS_TENANT: TenantLimits(tokens_per_minute=40)}, lambda: 0.0)
    app = AdmissionMiddleware(
        engine_route, Lifecycle(), admission, renders, limiter, ScriptedEngine()
    )
    # Each reserves 17: "a b" at four bytes a token, and 16 to generate. Two fit in 40.
    body = json.dumps({"prompt": "a b", "max_tokens": 16}).encode()

    def call(client: _Client) -> "asyncio.Task[None]":
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        return asyncio.create_task(app({**scope, "state": {}}, client.receive, client.send))

    first, second, third = _Client(body), _Client(body), _Client(body)
    calls = [call(first), call(second)]
    await _until(lambda: admission.running == 2)
    calls.append(call(third))
    await _until(lambda: third.status is not None or admission.running == 3)
    finish.set()
    await asyncio.gather(*calls)
    assert (first.status, second.status, third.status) == (200, 200, 429)
    error = json.loads(third.sent[-1]["body"])["error"]
    assert error["type"] == "tokens"
    assert "Limit 40, Used 34, Requested 17." in error["message"]
    remaining = [_header(c, b"x-ratelimit-remaining-tokens") for c in (first, second)]
    assert remaining == ["23", "6"]
    # They ended without generating (the route recorded no usage): both reservations came
    # back, so the next request finds the bucket full.
    fourth = _Client(body)
    await call(fourth)
    assert _header(fourth, b"x-ratelimit-remaining-tokens") == "23"


async def test_a_request_the_line_refuses_gets_its_reservation_back() -> None:
    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("never admitted")

    admission = AdmissionController(1, 0, queue_timeout_seconds=30)
    await admission.acquire(ONE)  # the engine is full and there is no line
    renders = AdmissionController(1, 1, queue_timeout_seconds=30)
    limiter = RateLimiter({ANONYMOUS_TENANT: TenantLimits(tokens_per_minute=40)}, lambda: 0.0)
    app = AdmissionMiddleware(route, Lifecycle(), admission, renders, limiter, ScriptedEngine())
    body = json.dumps({"prompt": "a b", "max_tokens": 16}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    for _ in range(3):  # more than two reservations of 17 would hold
        client = _Client(body)
        await app({**scope, "state": {}}, client.receive, client.send)
        assert client.status == 503
    assert (await limiter.admit(ANONYMOUS_TENANT, 40)).reserved_tokens == 40


async def test_render_calls_take_the_render_room_not_the_engines() -> None:
    admission = AdmissionController(1, 1, queue_timeout_seconds=30)
    renders = AdmissionController(1, 0, queue_timeout_seconds=30)
    finish = asyncio.Event()

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await finish.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    app = AdmissionMiddleware(
        route, Lifecycle(), admission, renders, RateLimiter({}), ScriptedEngine()
    )
    scope = {"type": "http", "method": "POST", "path": "/v1/completions/render", "headers": []}
    first, second = _Client(b"{}"), _Client(b"{}")
    calls = [asyncio.create_task(app({**scope, "state": {}}, first.receive, first.send))]
    await _until(lambda: renders.running == 1)
    assert admission.running == 0
    await app({**scope, "state": {}}, second.receive, second.send)
    assert second.status == 503  # no line for renders here: refused at once
    finish.set()
    await asyncio.gather(*calls)
    assert first.status == 200 and renders.idle


async def test_a_tenant_under_its_share_is_admitted_past_a_full_engine_first_in_priority() -> None:
    admission = AdmissionController(4, 16, queue_timeout_seconds=5, max_displacing=4)
    flood, light = admission.ticket("a", 1), admission.ticket("b", 1)
    # Alone, a fills the engine; each admission's priority is what a held before it.
    assert [admission.try_acquire(flood) for _ in range(4)] == [0, 1, 2, 3]
    assert admission.try_acquire(flood) is None
    queued_flood = asyncio.create_task(admission.acquire(flood))
    await _until(lambda: admission.queued == 1)
    # b holds nothing, under its share (4 slots / 2 tenants): past the full engine at once,
    # first in the engine's order, passing a's queued request.
    assert admission.try_acquire(light) == 0
    assert admission.try_acquire(light) == 1
    assert admission.running == 6
    # At its share, b waits like everyone.
    assert admission.try_acquire(light) is None
    for _ in range(2):
        admission.release(light, 1.0)
    # b's room was past the engine's: a's queued request waits for one of a's own to end.
    assert (admission.queued, admission.running) == (1, 4)
    admission.release(flood, 1.0)
    assert await queued_flood == 3  # a held three then
    for _ in range(4):
        admission.release(flood, 1.0)
    assert admission.idle


async def test_past_the_engine_only_within_max_displacing() -> None:
    no_displacing = AdmissionController(2, 8, queue_timeout_seconds=5)
    displacing = AdmissionController(2, 8, queue_timeout_seconds=5, max_displacing=1)
    for admission in (no_displacing, displacing):
        for _ in range(2):
            assert admission.try_acquire(admission.ticket("a", 1)) is not None
    # A render route's room (no displacing): b waits for a slot even holding nothing.
    assert no_displacing.try_acquire(no_displacing.ticket("b", 1)) is None
    assert displacing.try_acquire(displacing.ticket("b", 1)) == 0
    # The one sequence past the engine is taken: c, under its share too, waits.
    assert displacing.try_acquire(displacing.ticket("c", 1)) is None
