"""A client that goes away aborts its engine work."""

import asyncio

from server.api.replies import until_disconnected
from server.engine.contract import GenerationRequest, SamplingOptions
from tests.unit.scripted_engine import ScriptedEngine


async def test_non_streaming_work_is_cancelled_when_the_client_leaves() -> None:
    engine = ScriptedEngine(step_delay=0.05)
    gone = asyncio.Event()

    async def is_disconnected() -> bool:
        return gone.is_set()

    async def work() -> None:
        request = GenerationRequest("req-1", [1], SamplingOptions(max_tokens=100))
        async for _ in engine.generate(request):
            pass

    asyncio.get_running_loop().call_later(0.1, gone.set)
    assert await until_disconnected(is_disconnected, work(), poll_seconds=0.02) is None
    assert engine.aborted == ["req-1"]


async def test_work_that_finishes_first_returns_its_result() -> None:
    async def is_disconnected() -> bool:
        return False

    async def work() -> str:
        return "done"

    assert await until_disconnected(is_disconnected, work(), poll_seconds=0.02) == "done"
