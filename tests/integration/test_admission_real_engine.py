"""Many streaming clients at once against the real engine with tight admission
bounds: some hang up mid-stream, some are over the limit. Every finished
stream must be correct, every refusal a 503 with Retry-After, and afterwards
nothing is left running and the server still answers. A request past its
deadline is stopped in the engine too."""

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from server.traffic.admission_queue import AdmissionController
from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config

pytestmark = pytest.mark.integration

MAX_CONCURRENT, MAX_QUEUED = 8, 8
CLIENTS = 64
BODY = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
async def admission_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    admission = AdmissionController(MAX_CONCURRENT, MAX_QUEUED, queue_timeout_seconds=300)
    config = tiny_engine_config(tiny, tiny.close_draft)
    async for running in serve(config, admission=admission):
        yield running


@dataclass
class Outcome:
    status: int
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    error: dict[str, object] | None = None
    retry_after: str | None = None


async def _client(base_url: str, hang_up: bool) -> Outcome:
    # One connection per client, as separate users would have.
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=300) as http,
        http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response,
    ):
        if response.status_code != 200:
            await response.aread()
            return Outcome(
                response.status_code,
                error=response.json()["error"],
                retry_after=response.headers.get("retry-after"),
            )
        outcome = Outcome(200)
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                outcome.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                outcome.error = chunk.get("error")
                for choice in chunk.get("choices", []):
                    outcome.text += choice["text"]
                    outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
                if hang_up and outcome.text:
                    return outcome
        return outcome


async def _metric(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in " {"
    ]
    return sum(values)


async def _wait_metric_zero(http: httpx.AsyncClient, name: str, seconds: float) -> None:
    """Wait up to `seconds` for `name` to read 0: a stream whose client hung up
    gives back its slot only once the server has noticed and torn it down."""
    for _ in range(round(seconds * 10)):
        if await _metric(http, name) == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} is still {await _metric(http, name)}")


async def test_concurrent_streams_with_disconnects_and_refusals(
    admission_server: RunningServer,
) -> None:
    base_url = admission_server.base_url
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        reference = (await http.post("/v1/completions", json=BODY)).json()["choices"][0]["text"]
        hang_ups = [i % 4 == 1 for i in range(CLIENTS)]
        outcomes = await asyncio.gather(*(_client(base_url, h) for h in hang_ups))

        finished = [o for o, h in zip(outcomes, hang_ups, strict=True) if o.status == 200 and not h]
        refused = [o for o in outcomes if o.status != 200]
        assert finished, "no stream finished"
        for outcome in finished:
            assert outcome.error is None and outcome.done
            assert outcome.text == reference
            assert outcome.finish_reason == "length"
        # At most MAX_CONCURRENT + MAX_QUEUED fit at once; hang-ups free slots early.
        assert len(refused) >= CLIENTS - 2 * (MAX_CONCURRENT + MAX_QUEUED)
        for outcome in refused:
            assert outcome.status == 503
            assert outcome.error is not None and outcome.error["code"] == "server_overloaded"
            assert outcome.retry_after is not None and int(outcome.retry_after) >= 1

        # The bounds only stop a hang: teardown after hang-ups takes what it takes.
        await admission_server.wait_engine_idle(120)
        in_flight = 'specserve_requests_in_flight{endpoint="/v1/completions"}'
        for name in ("specserve_requests_running", "specserve_requests_queued", in_flight):
            await _wait_metric_zero(http, name, 120)
        again = await http.post("/v1/completions", json=BODY)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == reference
    print(
        f"\n{CLIENTS} clients: {len(finished)} finished, {hang_ups.count(True)} hung up, "
        f"{len(refused)} refused with 503"
    )


async def test_a_deadline_aborts_the_real_generation(admission_server: RunningServer) -> None:
    # Hundreds of tokens take seconds on the tiny model; the deadline is 0.3 s.
    long_body = {**BODY, "prompt": "x", "max_tokens": 450}
    admission_server.app.state.request_timeout_seconds = 0.3
    try:
        async with httpx.AsyncClient(base_url=admission_server.base_url, timeout=300) as http:
            plain = await http.post("/v1/completions", json=long_body)
            streamed = await http.post("/v1/completions", json={**long_body, "stream": True})
    finally:
        admission_server.app.state.request_timeout_seconds = None
    assert plain.status_code == 504
    assert plain.json()["error"]["code"] == "request_timeout"
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert events[-1] == "data: [DONE]"
    await admission_server.wait_engine_idle(120)
