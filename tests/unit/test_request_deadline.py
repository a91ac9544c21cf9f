"""A request's deadline bounds its waits for the engine, never our own sending."""

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import pytest

from server.engine.contract import EngineOutput, GenerationRequest, SamplingOptions
from server.errors import RequestTimeoutError
from server.serving.common import generate_all
from server.serving.observer import RequestObserver
from tests.unit.scripted_engine import ScriptedEngine


class _SilentEngine(ScriptedEngine):
    """Takes the request and never answers, until closed."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()
        self.generated = self.closed_count = 0

    @property
    def closed(self) -> bool:
        return self.closed_count == self.generated > 0

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        self.generated += 1
        try:
            self.waiting.set()
            await asyncio.Event().wait()
            yield EngineOutput(1, [])
        finally:
            self.closed_count += 1


def _request() -> list[GenerationRequest]:
    return [GenerationRequest("req-1", [1, 2], SamplingOptions(max_tokens=7))]


def _observer() -> RequestObserver:
    return RequestObserver("scripted", "completions", time.perf_counter(), "default")


async def test_a_deadline_passing_while_the_engine_is_silent_stops_the_request() -> None:
    engine = _SilentEngine()
    deadline = time.perf_counter() + 0.05
    outputs = generate_all(engine, _request(), _observer(), deadline)
    with pytest.raises(RequestTimeoutError, match="request timeout"):
        await anext(outputs)
    assert engine.closed


async def test_a_deadline_passing_while_an_output_is_sent_stops_the_request_after_it() -> None:
    engine = ScriptedEngine()  # outputs at once: the wait never suspends
    deadline = time.perf_counter() + 0.01
    async with aclosing(generate_all(engine, _request(), _observer(), deadline)) as outputs:
        await anext(outputs)
        # "Sending" until after the deadline: the timer (due first) fires meanwhile and
        # must not interrupt this.
        await asyncio.sleep(0.05)
        with pytest.raises(RequestTimeoutError):
            await anext(outputs)
    assert engine.aborted == ["req-1"]


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    engine = _SilentEngine()
    deadline = time.perf_counter() + 600

    async def consume() -> None:
        async with aclosing(generate_all(engine, _request(), _observer(), deadline)) as outputs:
            await anext(outputs)

    task = asyncio.create_task(consume())
    await engine.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.closed


async def test_a_deadline_stops_every_prompt_of_a_request() -> None:
    engine = _SilentEngine()
    requests = [
        GenerationRequest(f"req-{i}", [1, 2], SamplingOptions(max_tokens=7)) for i in range(2)
    ]
    deadline = time.perf_counter() + 0.05
    outputs = generate_all(engine, requests, _observer(), deadline)
    with pytest.raises(RequestTimeoutError):
        await anext(outputs)
    assert engine.generated == 2 and engine.closed_count == 2
