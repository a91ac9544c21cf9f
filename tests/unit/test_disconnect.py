"""A client that goes away aborts its engine work."""

import asyncio

from server.serving.common import until_disconnected
from tests.unit.scripted_engine import ScriptedEngine


async def test_non_streaming_work_is_cancelled_when_the_client_leaves() -> None:
    engine = ScriptedEngine(step_delay=0.05)
    gone = asyncio.Event()

    async def is_disconnected() -> bool:
        return gone.is_set()

    async def work() -> None:
        from server.engine.base import GenerationRequest, SamplingOptions

        request = GenerationRequest("req-1", [1], SamplingOptions(max_tokens=100))
        async for _ in engine.generate(request):
            pass

    asyncio.get_running_loop().call_later(0.1, gone.set)
    try:
        await until_disconnected(is_disconnected, work(), poll_seconds=0.02)
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("work should have been cancelled")
    assert engine.aborted == ["req-1"]
