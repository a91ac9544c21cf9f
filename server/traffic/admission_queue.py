"""Admission control: how many sequences run in the engine at once, how many may wait for
room, and who among the waiting tenants gets the room that frees.

Capacity and the line are counted in sequences (a request's prompts times its `n`), the
unit the engine batches: a request with `n: 16` takes sixteen of the slots, not one. A
request wider than the whole engine takes all of it.

Fairness between tenants: when room frees, it goes to the waiting tenant that holds the
least of the engine (sequences in flight); among tenants holding as much, to the one
admitted longest ago (turns); within a tenant, the earliest request first. A tenant can
fill the engine while nobody else waits; when someone arrives holding less than its share
(the slots divided among the tenants holding or waiting), it does not wait for the
flood's requests to end: it is admitted past the slots (at most `max_displacing` sequences
past them) and the engine gives way. Each admission carries a priority for the engine's
scheduler, the sequences its tenant held when it was admitted (fewer goes first), and
specserve's scheduler preempts the running sequence with the largest priority for a
waiting one with a smaller (vllm_plugins/give_way.py): the newest of the flood's requests
steps back (vLLM recomputes it later; nothing it produced is lost) within a step. Where
specserve's scheduler does not run (GPUs without --gpu-engine-patches), vLLM's priority
queue still serves the newcomer first as soon as a sequence ends. This is the smallest rule
that keeps a flood from starving a light user, needs no configuration, and works the same
with one tenant (then it is arrival order and nothing is preempted).

Past the bounds a request is refused at once instead of queueing without limit: 503 when
the shared line is full, 429 when its own tenant already has its share of the line
waiting (`--max-queued-per-tenant`, half the line unless set; with API keys on), so one
tenant's flood is refused before it fills the line for everyone. Both carry a
`Retry-After` estimate. A waiter that waits longer than the queue timeout is refused too.
"""

import asyncio
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from server.errors import OverloadedError, RateLimitError
from server.metrics import QUEUE_WAIT, QUEUED, REFUSED, RUNNING

# Weight of the newest request in the running mean of how long a slot is held.
_HOLD_SMOOTHING = 0.2
_MAX_RETRY_AFTER_SECONDS = 60
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Ticket:
    """What one request holds, or waits for: its tenant's share of the engine."""

    tenant: str
    sequences: int


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
    future: asyncio.Future[int]  # its priority once admitted
    arrival: int  # order of arrival across tenants


class AdmissionController:
    """Room for `max_concurrent` sequences in the engine plus a bounded line of waiters,
    served to the tenant holding the least first; up to `max_displacing` sequences more for
    tenants under their share, for whom the engine preempts others."""

    def __init__(
        self,
        max_concurrent: int,
        max_queued: int,
        queue_timeout_seconds: float,
        max_queued_per_tenant: int | None = None,
        max_displacing: int = 0,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.max_displacing = max_displacing
        self.max_queued = max_queued
        self.max_queued_per_tenant = (
            max_queued_per_tenant if max_queued_per_tenant is not None else max(1, max_queued // 2)
        )
        self.queue_timeout_seconds = queue_timeout_seconds
        self.running = 0  # sequences admitted
        self._held: defaultdict[str, int] = defaultdict(int)  # sequences admitted, by tenant
        self._lines: defaultdict[str, deque[_Waiter]] = defaultdict(deque)
        self._arrivals = 0
        self._admissions = 0
        self._last_admitted: dict[str, int] = {}  # tenant -> its latest admission's number
        self._mean_hold_seconds = 1.0

    @property
    def queued(self) -> int:
        """Sequences waiting for room."""
        return sum(waiter.ticket.sequences for line in self._lines.values() for waiter in line)

    @property
    def idle(self) -> bool:
        return self.running == 0 and not any(self._lines.values())

    def held_by(self, tenant: str) -> int:
        """Sequences `tenant` has in the engine."""
        return self._held.get(tenant, 0)

    def ticket(self, tenant: str = ANONYMOUS, sequences: int = 1) -> Ticket:
        """What a request of `sequences` sequences takes: at least one, at most the engine."""
        return Ticket(tenant, min(max(1, sequences), self.max_concurrent))

    def try_acquire(self, ticket: Ticket) -> int | None:
        """Take the ticket's room without waiting if it fits and its tenant holds less than
        every tenant waiting (who would be served first otherwise); its engine priority,
        None if not admitted."""
        heads = [line[0] for line in self._lines.values() if line]
        if any(self.held_by(ticket.tenant) >= self.held_by(w.ticket.tenant) for w in heads):
            return None
        if not self._fits(ticket):
            return None
        QUEUE_WAIT.observe(0.0)
        return self._take(ticket)

    async def acquire(self, ticket: Ticket) -> int:
        """Take the ticket's room, waiting in line if need be, and return its engine
        priority; raise `OverloadedError` when the line is full or the wait exceeds the
        queue timeout, `RateLimitError` when the ticket's tenant already has its share of
        the line waiting."""
        priority = self.try_acquire(ticket)
        if priority is not None:
            return priority
        if self.queued + ticket.sequences > self.max_queued:
            REFUSED.labels("queue_full").inc()
            raise OverloadedError(
                f"The server is at capacity ({self.running} sequences running, "
                f"{self.queued} waiting: --max-concurrent-requests, "
                "--max-queued-requests); retry later",
                headers={"Retry-After": str(self.retry_after_seconds())},
            )
        line = self._lines[ticket.tenant]
        waiting = sum(waiter.ticket.sequences for waiter in line)
        # Without keys everyone is one anonymous tenant: the shared line is its bound.
        if ticket.tenant != ANONYMOUS and waiting + ticket.sequences > self.max_queued_per_tenant:
            REFUSED.labels("tenant_queue_full").inc()
            raise RateLimitError(
                f"This key already has {waiting} sequences waiting for the engine, the most "
                f"one key may queue (--max-queued-per-tenant {self.max_queued_per_tenant}); "
                "retry later",
                kind="requests",
                headers={"Retry-After": str(self.retry_after_seconds())},
            )
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(ticket, future, self._arrivals)
        self._arrivals += 1
        line.append(waiter)
        QUEUED.set(self.queued)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.queue_timeout_seconds):
                priority = await future
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
            QUEUED.set(self.queued)
        QUEUE_WAIT.observe(time.perf_counter() - started)
        return priority

    def release(self, ticket: Ticket, held_seconds: float) -> None:
        """Give back the ticket's room, held for `held_seconds`, to the waiters."""
        self._mean_hold_seconds += _HOLD_SMOOTHING * (held_seconds - self._mean_hold_seconds)
        self._give_back(ticket)

    def retry_after_seconds(self) -> int:
        """When room is likely free for one more request: the line ahead of it divided
        among the slots, at the recent mean time a slot is held."""
        ahead = self.queued + 1
        estimate = self._mean_hold_seconds * ahead / self.max_concurrent
        return max(1, min(_MAX_RETRY_AFTER_SECONDS, math.ceil(estimate)))

    def _under_share(self, ticket: Ticket) -> bool:
        """Whether the ticket's tenant, with it, holds at most its share: the slots divided
        among the tenants holding or waiting, itself included."""
        present = {*self._held, *(t for t, line in self._lines.items() if line), ticket.tenant}
        share = self.max_concurrent // len(present)
        return self.held_by(ticket.tenant) + ticket.sequences <= share

    def _fits(self, ticket: Ticket) -> bool:
        """Room for the ticket now: free slots, or for a tenant under its share the slots
        the engine frees by preempting others (within `max_displacing`)."""
        if self.running + ticket.sequences <= self.max_concurrent:
            return True
        within = self.running + ticket.sequences <= self.max_concurrent + self.max_displacing
        return within and self._under_share(ticket)

    def _take(self, ticket: Ticket) -> int:
        """Admit the ticket; its engine priority is what its tenant held before it."""
        priority = self.held_by(ticket.tenant)
        self.running += ticket.sequences
        self._held[ticket.tenant] += ticket.sequences
        self._admissions += 1
        self._last_admitted[ticket.tenant] = self._admissions
        RUNNING.set(self.running)
        return priority

    def _give_back(self, ticket: Ticket) -> None:
        self.running -= ticket.sequences
        self._held[ticket.tenant] -= ticket.sequences
        if not self._held[ticket.tenant]:
            del self._held[ticket.tenant]
        RUNNING.set(self.running)
        self._pass_on()

    def _pass_on(self) -> None:
        """Admit waiters while room allows: the head of the line of the tenant holding the
        least; among equals, the tenant admitted longest ago (turns, so the room a tenant
        gives back does not return to it while another waits), then the earliest. The
        chosen head waits for room rather than letting narrower requests pass it, so a wide
        request is not starved."""
        while True:
            for tenant in [tenant for tenant, line in self._lines.items() if not line]:
                del self._lines[tenant]
            if not self._lines:
                return
            head = min(
                (line[0] for line in self._lines.values()),
                key=lambda waiter: (
                    self.held_by(waiter.ticket.tenant),
                    self._last_admitted.get(waiter.ticket.tenant, 0),
                    waiter.arrival,
                ),
            )
            if head.future.done():  # cancelled, its waiter not yet resumed to leave
                self._lines[head.ticket.tenant].popleft()
                continue
            if not self._fits(head.ticket):
                return
            self._lines[head.ticket.tenant].popleft()
            head.future.set_result(self._take(head.ticket))

    def _give_up(self, waiter: _Waiter) -> None:
        line = self._lines.get(waiter.ticket.tenant)
        if line is not None and waiter in line:
            line.remove(waiter)
            self._pass_on()  # a wide head leaving may let narrower waiters in
        elif waiter.future.done() and not waiter.future.cancelled():
            # Admitted just as the wait ended: its room goes back to the line.
            self._give_back(waiter.ticket)
