"""Admission control: how many generation requests run in the engine at once,
and how many may wait for a slot.

Past the bounds a request is refused at once with 503 and a `Retry-After`
estimate instead of queueing without limit, so a burst degrades into fast,
retryable refusals rather than timeouts for everyone. Waiters are served in
arrival order; one that waits longer than the queue timeout is refused too.
"""

import asyncio
import math
import time
from collections import deque

from server.errors import OverloadedError
from server.metrics import QUEUE_WAIT, QUEUED, REFUSED, RUNNING

# Weight of the newest request in the running mean of how long a slot is held.
_HOLD_SMOOTHING = 0.2
_MAX_RETRY_AFTER_SECONDS = 60


class AdmissionController:
    """Slots for generation requests plus a bounded FIFO of waiters."""

    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_seconds: float) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_seconds = queue_timeout_seconds
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._mean_hold_seconds = 1.0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def idle(self) -> bool:
        return self.running == 0 and not self._waiters

    def try_acquire(self) -> bool:
        """Take a free slot if one is free and nobody waits for it, without waiting."""
        if self.running < self.max_concurrent and not self._waiters:
            self.running += 1
            RUNNING.set(self.running)
            QUEUE_WAIT.observe(0.0)
            return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in line if need be; raise `OverloadedError`
        when the line is full or the wait exceeds the queue timeout."""
        if self.try_acquire():
            return
        if len(self._waiters) >= self.max_queued:
            REFUSED.labels("queue_full").inc()
            raise OverloadedError(
                f"The server is at capacity ({self.running} requests running, "
                f"{len(self._waiters)} waiting: --max-concurrent-requests, "
                "--max-queued-requests); retry later",
                headers={"Retry-After": str(self.retry_after_seconds())},
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        QUEUED.set(len(self._waiters))
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout_seconds):
                await waiter
        except TimeoutError:
            self._give_up(waiter)
            REFUSED.labels("queue_timeout").inc()
            raise OverloadedError(
                f"No engine slot freed up within {self.queue_timeout_seconds:g} s "
                "(--queue-timeout-seconds); retry later",
                headers={"Retry-After": str(self.retry_after_seconds())},
            ) from None
        except asyncio.CancelledError:
            self._give_up(waiter)
            raise
        finally:
            QUEUED.set(len(self._waiters))
        QUEUE_WAIT.observe(time.perf_counter() - started)

    def release(self, held_seconds: float) -> None:
        """Give back a slot held for `held_seconds`: to the next waiter if any."""
        self._mean_hold_seconds += _HOLD_SMOOTHING * (held_seconds - self._mean_hold_seconds)
        self._pass_on()

    def _pass_on(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands; `running` stays
                return
        self.running -= 1
        RUNNING.set(self.running)

    def retry_after_seconds(self) -> int:
        """When a slot is likely free for one more request: the line ahead of
        it divided among the slots, at the recent mean time a slot is held."""
        ahead = len(self._waiters) + 1
        estimate = self._mean_hold_seconds * ahead / self.max_concurrent
        return max(1, min(_MAX_RETRY_AFTER_SECONDS, math.ceil(estimate)))

    def _give_up(self, waiter: asyncio.Future[None]) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        elif waiter.done() and not waiter.cancelled():
            # The slot was handed over just as the wait ended: pass it on.
            self._pass_on()
