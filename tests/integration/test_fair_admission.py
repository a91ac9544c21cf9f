"""Two keyed tenants sharing the real engine: while tenant A keeps wide requests (`n: 4`)
queued and render calls in flight, tenant B's short requests are admitted at once, ahead of
A's queued work, and none is refused; A's flood past its share of the line gets 429s. With
the engine full of A's long requests, it gives way: B's request ends before any of A's,
which lose nothing (greedy output as alone)."""

import asyncio
import json
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
        super().__init__(
            ENGINE_SEQUENCES,
            LINE,
            300,
            max_queued_per_tenant=SHARE,
            max_displacing=ENGINE_SEQUENCES,
        )
        self.events: list[tuple[str, str, int]] = []  # (what, tenant, sequences queued then)

    async def acquire(self, ticket: Ticket) -> int:
        # The middleware calls this once its `try_acquire` found no room.
        self.events.append(("arrive", ticket.tenant, self.queued))
        return await super().acquire(ticket)

    def _take(self, ticket: Ticket) -> int:
        priority = super()._take(ticket)
        self.events.append(("admit", ticket.tenant, self.queued))
        return priority


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
    # B held less than its share: admitted at once, never in line, the first time while
    # A's work waited.
    b_events = [(what, queued) for what, tenant, queued in events if tenant == "b"]
    assert [what for what, _ in b_events] == ["admit", "admit"]
    assert b_events[0][1] > 0
    assert admission.idle


@pytest.fixture(scope="module")
async def full_engine(tiny: TinyModels) -> AsyncIterator[tuple[RunningServer, int]]:
    """A server whose engine runs as many sequences as the admission's slots, with the draft
    (specserve's scheduler, which gives way); and the tiny model's end-of-text id."""
    from transformers import AutoTokenizer

    admission = AdmissionController(
        ENGINE_SEQUENCES, LINE, 300, max_queued_per_tenant=SHARE, max_displacing=ENGINE_SEQUENCES
    )
    config = tiny_engine_config(
        tiny, tiny.close_draft, served_model_name="tiny", max_num_seqs=ENGINE_SEQUENCES
    )
    eos = AutoTokenizer.from_pretrained(tiny.target).eos_token_id
    async for running in serve(config, api_keys=ApiKeys(KeyRing(KEYS)), admission=admission):
        yield running, eos


async def _preemptions(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_full_engine_gives_way_to_a_light_tenant_and_loses_nothing(
    full_engine: tuple[RunningServer, int],
) -> None:
    server, eos = full_engine
    # Greedy, and long for sure: the end of text is banned.
    long = {
        "model": "tiny",
        "max_tokens": 200,
        "temperature": 0,
        "logit_bias": {str(eos): -100},
    }
    prompts = [f"def f{i}(x):" for i in range(ENGINE_SEQUENCES)]
    flood = httpx.AsyncClient(
        base_url=server.base_url, headers={"Authorization": f"Bearer {FLOOD}"}, timeout=600
    )
    light = httpx.AsyncClient(
        base_url=server.base_url, headers={"Authorization": f"Bearer {LIGHT}"}, timeout=600
    )
    async with flood, light:
        first_tokens = [asyncio.Event() for _ in prompts]

        async def streamed(prompt: str, started: asyncio.Event) -> str:
            text = ""
            body = {**long, "prompt": prompt, "stream": True}
            async with flood.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        text += json.loads(line[len("data: ") :])["choices"][0]["text"]
            return text

        floods = [
            asyncio.create_task(streamed(p, e)) for p, e in zip(prompts, first_tokens, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in first_tokens))  # A runs in every slot
        before = await _preemptions(light)
        answer = await light.post("/v1/completions", json=SHORT)
        assert answer.status_code == 200
        # B ended while all of A's were still running: the engine preempted one for it.
        assert not any(task.done() for task in floods)
        texts = await asyncio.gather(*floods)
        await _until_async(lambda: _preemptions(light), lambda count: count > before)
        # Preempted and recomputed, A's requests lost nothing: each as it runs alone.
        for prompt, text in zip(prompts, texts, strict=True):
            alone = await flood.post("/v1/completions", json={**long, "prompt": prompt})
            assert alone.json()["choices"][0]["text"] == text


async def _until_async(read: Any, check: Any) -> None:
    for _ in range(3_000):  # bounded only to stop a hang
        if check(await read()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")
