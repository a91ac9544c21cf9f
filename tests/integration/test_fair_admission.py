"""Two keyed tenants sharing the real engine: while tenant A keeps wide requests (`n: 4`)
queued and render calls in flight, tenant B's short requests are admitted ahead of A's
queued work and none is refused; A's flood past its share of the line gets 429s."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from server.traffic.admission_queue import AdmissionController, Ticket
from server.traffic.api_keys import ApiKeys, KeyRing
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config

pytestmark = pytest.mark.integration

KEYS = {"sk-fair-flood-0123": "a", "sk-fair-light-4567": "b"}
FLOOD, LIGHT = KEYS
ENGINE_SEQUENCES, LINE, SHARE = 4, 16, 8
WIDE = {"model": "tiny", "prompt": "def add(a, b):", "n": 4, "max_tokens": 300, "temperature": 1}
SHORT = {"model": "tiny", "prompt": "x = ", "max_tokens": 4, "temperature": 0}


class RecordingAdmission(AdmissionController):
    """The real controller, writing down who arrived in line and who was admitted, in order."""

    def __init__(self) -> None:
        super().__init__(ENGINE_SEQUENCES, LINE, 300, max_queued_per_tenant=SHARE)
        self.events: list[tuple[str, str, int]] = []  # (what, tenant, sequences queued then)

    async def acquire(self, ticket: Ticket) -> None:
        # The middleware calls this once its `try_acquire` found no room.
        self.events.append(("arrive", ticket.tenant, self.queued))
        await super().acquire(ticket)

    def _take(self, ticket: Ticket) -> None:
        super()._take(ticket)
        self.events.append(("admit", ticket.tenant, self.queued))


@pytest.fixture(scope="module")
async def shared(tiny: TinyModels) -> AsyncIterator[tuple[RunningServer, RecordingAdmission]]:
    admission = RecordingAdmission()
    renders = AdmissionController(2, 2, 300)
    config = tiny_engine_config(tiny, None, served_model_name="tiny")
    async for running in serve(
        config,
        api_keys=ApiKeys(KeyRing(KEYS)),
        admission=admission,
        render_admission=renders,
    ):
        yield running, admission


async def _until(check: Any) -> None:
    for _ in range(30_000):  # bounded only to stop a hang
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


async def test_a_light_tenant_goes_ahead_of_a_floods_queued_work(
    shared: tuple[RunningServer, RecordingAdmission],
) -> None:
    server, admission = shared
    flood = httpx.AsyncClient(
        base_url=server.base_url, headers={"Authorization": f"Bearer {FLOOD}"}, timeout=600
    )
    light = httpx.AsyncClient(
        base_url=server.base_url, headers={"Authorization": f"Bearer {LIGHT}"}, timeout=600
    )
    async with flood, light:
        wide = [asyncio.create_task(flood.post("/v1/completions", json=WIDE)) for _ in range(6)]
        renders = [
            asyncio.create_task(flood.post("/v1/completions/render", json=WIDE)) for _ in range(8)
        ]
        # One wide request fills the engine, two more are A's share of the line, three are
        # refused at once.
        await _until(lambda: admission.queued == SHARE and sum(t.done() for t in wide) == 3)
        refused = [t.result() for t in wide if t.done()]
        queued_or_running = [t for t in wide if not t.done()]
        assert [r.status_code for r in refused] == [429] * 3
        for response in refused:
            error = response.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
            assert "--max-queued-per-tenant" in error["message"]
            assert int(response.headers["retry-after"]) >= 1

        answers = []
        for _ in range(2):
            answers.append(await light.post("/v1/completions", json=SHORT))
        assert [r.status_code for r in answers] == [200, 200]

        finished = await asyncio.gather(*queued_or_running)
        assert [r.status_code for r in finished] == [200] * 3
        assert all(len(r.json()["choices"]) == 4 for r in finished)
        assert {r.status_code for r in await asyncio.gather(*renders)} <= {200, 429, 503}

    events = admission.events
    arrivals = [
        i for i, (what, tenant, _) in enumerate(events) if (what, tenant) == ("arrive", "b")
    ]
    admits = [i for i, (what, tenant, _) in enumerate(events) if (what, tenant) == ("admit", "b")]
    assert len(admits) == 2
    # The first of B's requests found A's work waiting, and waited for room itself.
    assert arrivals and events[arrivals[0]][2] > 0
    for arrived in arrivals:
        admitted = next(i for i in admits if i > arrived)
        between = [tenant for what, tenant, _ in events[arrived:admitted] if what == "admit"]
        assert between == [], f"A was admitted ahead of B: {events}"
    assert admission.idle
