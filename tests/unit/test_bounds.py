"""What a slow client can make the server hold is bounded."""

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from server.engine.contract import GenerationRequest, SamplingOptions
from server.serving.common import _merged


class _FloodingEngine:
    """Each request's outputs come as fast as they are taken."""

    def __init__(self) -> None:
        self.produced: Counter[str] = Counter()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Any]:
        while True:
            self.produced[request.request_id] += 1
            yield object()


async def test_a_slow_reader_of_several_prompts_holds_the_producers_back() -> None:
    engine = _FloodingEngine()
    requests = [GenerationRequest(f"r{i}", [1], SamplingOptions(max_tokens=10)) for i in range(4)]
    async with aclosing(_merged(engine, requests)) as outputs:  # type: ignore[arg-type]
        await anext(outputs)
        for _ in range(1000):  # every producer gets many turns while nothing is read
            await asyncio.sleep(0)
        # One taken, one per producer in the bounded queue, one per producer waiting to put.
        assert sum(engine.produced.values()) <= 1 + 2 * len(requests)
        assert set(engine.produced) == {r.request_id for r in requests}
