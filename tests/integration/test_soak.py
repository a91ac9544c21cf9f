"""Soak: two identical rounds of hostile traffic against `specserve serve` on the real engine
(tiny models, draft speculation on), rate limits in a real Redis, and afterwards nothing left
behind.

Each round: a burst of long requests overflows the queue (503) and outlives the deadline
(504); then mixed streaming and plain requests, 30% of them hung up by their client, a
rate-limited tenant (429), one key reload by SIGHUP and one Redis restart midway. After each
round the test waits until the engine holds no request and every in-flight, running and
queued gauge is back at zero; every client outcome is one of done, 429, 503, 504 or hung up,
and what the server counted agrees with what the clients saw. The server process's resident
memory after the second round is within 5% of after the first. Figures are printed (`-s`).
"""

import asyncio
import json
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from loadtest.launch import wait_until_up
from tests.integration.conftest import TinyModels, tiny_serve_command
from tests.net import free_port, wait_until
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

TEAM_KEY = "sk-team"
LIMITED_KEY = "sk-limited"
LIMITED_REQUESTS_PER_MINUTE = 1
MAX_RUNNING, MAX_QUEUED = 2, 4
# Short enough that the burst's long requests (1900 tokens: about two seconds of the compiled
# tiny models on a fast CPU) outlive it, long enough for the mixed round's short ones (16
# tokens) to finish; a mixed request past it is a 504 the test accepts.
REQUEST_TIMEOUT_SECONDS = 1
BURST = 10  # more than running plus queued: some are refused at once
MIXED = 120
CLIENTS = 4  # at most running plus queued: the burst is what overflows
LONG = {"prompt": "x", "max_tokens": 1900, "temperature": 0}
SHORT = {"prompt": "a b c", "max_tokens": 16, "temperature": 0}
MESSAGES = [{"role": "user", "content": "say something"}]
# A hung-up plain request gives up waiting for its response after this long.
HANG_UP_AFTER_SECONDS = 0.2


@dataclass
class Round:
    outcomes: Counter[str] = field(default_factory=Counter)  # done, 429, 503, 504, hung up
    # HTTP statuses the clients of /v1/completions saw (that endpoint is never hung up on,
    # so the server must count exactly these).
    completions_statuses: Counter[str] = field(default_factory=Counter)
    chat_requests: int = 0


def _outcome(status: int, events: list[dict[str, object]] | None = None) -> str:
    if status == 200 and events and "error" in events[-1]:
        error = events[-1]["error"]
        assert isinstance(error, dict) and error["code"] == "request_timeout", events[-1]
        return "504"
    assert status in (200, 429, 503, 504), status
    return "done" if status == 200 else str(status)


async def _completion(
    client: httpx.AsyncClient, body: dict[str, object], key: str
) -> tuple[str, int]:
    """One /v1/completions request read to its end: its outcome and HTTP status."""
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        response = await client.post("/v1/completions", json=body, headers=headers)
        return _outcome(response.status_code), response.status_code
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        events = [
            json.loads(line.removeprefix("data: "))
            async for line in response.aiter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    return _outcome(response.status_code, events), response.status_code


async def _hung_up_chat(client: httpx.AsyncClient, stream: bool) -> str:
    """A /v1/chat/completions request whose client leaves early: after the first event of a
    stream, or before a plain response arrives (unless it was refused or done by then)."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 64, "stream": stream}
    headers = {"Authorization": f"Bearer {TEAM_KEY}"}
    if not stream:
        try:
            response = await asyncio.wait_for(
                client.post("/v1/chat/completions", json=body, headers=headers),
                HANG_UP_AFTER_SECONDS,
            )
        except TimeoutError:
            return "hung up"
        return _outcome(response.status_code)
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers=headers
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return _outcome(response.status_code)
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return "hung up"  # leaving the block closes the connection
    raise AssertionError("stream ended without an event")


def _samples(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _by_last_label(samples: dict[str, float], prefix: str) -> Counter[str]:
    """The samples whose name starts with `prefix` (which ends inside their last label's
    quotes), counted by that label's value."""
    return Counter(
        {name[len(prefix) : -2]: int(v) for name, v in samples.items() if name.startswith(prefix)}
    )


def _requests_by_status(samples: dict[str, float], endpoint: str) -> Counter[str]:
    return _by_last_label(samples, f'specserve_requests_total{{endpoint="{endpoint}",status="')


def _refused(samples: dict[str, float]) -> Counter[str]:
    return _by_last_label(samples, 'specserve_requests_refused_total{reason="')


def _write_keys(path: Path, round_number: int) -> None:
    keys = [
        {"key": TEAM_KEY, "tenant": "team"},
        {"key": LIMITED_KEY, "tenant": "limited",
         "requests_per_minute": LIMITED_REQUESTS_PER_MINUTE},
        {"key": f"sk-round-{round_number}", "tenant": "team"},
    ]  # fmt: skip
    path.write_text(json.dumps({"keys": keys}))


class Soak:
    def __init__(self, popen: subprocess.Popen[str], base_url: str, metrics_url: str) -> None:
        self.popen = popen
        self.client = httpx.AsyncClient(base_url=base_url, timeout=120)
        self.metrics_url = metrics_url

    async def scrape(self) -> dict[str, float]:
        return _samples((await self.client.get(self.metrics_url)).text)

    async def run_round(self, number: int, key_file: Path, redis_server: RedisServer) -> Round:
        result = Round()

        def record(outcome: str, status: int | None = None) -> None:
            result.outcomes[outcome] += 1
            if status is not None:
                result.completions_statuses[str(status)] += 1

        # The burst: every request at once, each longer than the deadline.
        burst = [
            _completion(self.client, {**LONG, "model": "tiny", "stream": i % 2 == 1}, TEAM_KEY)
            for i in range(BURST)
        ]
        for outcome, status in await asyncio.gather(*burst):
            record(outcome, status)

        pending = list(range(MIXED))

        async def client_loop() -> None:
            while pending:
                i = pending.pop(0)
                if i == MIXED // 3:
                    await self._reload_keys(key_file, number)
                if i == 2 * MIXED // 3:
                    await asyncio.to_thread(redis_server.stop)
                    await asyncio.to_thread(redis_server.start)
                stream = i % 2 == 0
                if i % 10 < 3:  # 30% hang up
                    result.chat_requests += 1
                    record(await _hung_up_chat(self.client, stream))
                else:
                    key = LIMITED_KEY if i % 10 == 3 else TEAM_KEY
                    body = {**SHORT, "model": "tiny", "stream": stream}
                    record(*await _completion(self.client, body, key))

        await asyncio.gather(*(client_loop() for _ in range(CLIENTS)))
        await self._wait_idle()
        return result

    async def _reload_keys(self, key_file: Path, number: int) -> None:
        _write_keys(key_file, number)
        self.popen.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            headers = {"Authorization": f"Bearer sk-round-{number}"}
            return (await self.client.get("/v1/models", headers=headers)).status_code == 200

        await wait_until(reloaded, f"round {number}'s key was not accepted after SIGHUP", 60)

    async def _wait_idle(self) -> None:
        gauges = (
            "specserve_engine_requests",
            "specserve_requests_running",
            "specserve_requests_queued",
            'specserve_requests_in_flight{endpoint="/v1/completions"}',
            'specserve_requests_in_flight{endpoint="/v1/chat/completions"}',
        )

        async def idle() -> bool:
            samples = await self.scrape()
            return all(samples[gauge] == 0 for gauge in gauges)

        await wait_until(idle, "requests were left in the engine or the gauges", 120)


def _resident_mb(pid: int) -> tuple[float, float]:
    """Resident MiB of the server process, and of it with its engine processes."""
    server = psutil.Process(pid)
    own = server.memory_info().rss
    children = sum(child.memory_info().rss for child in server.children(recursive=True))
    return own / 2**20, (own + children) / 2**20


async def test_two_rounds_of_hostile_traffic_leave_nothing_behind(
    tiny: TinyModels, tmp_path: Path
) -> None:
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    key_file = tmp_path / "keys.json"
    _write_keys(key_file, 0)
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "server.log"
    command = tiny_serve_command(
        tiny, port, metrics_port,
        "--api-key-file", str(key_file), "--rate-limit-store", redis_server.url,
        "--max-concurrent-requests", str(MAX_RUNNING),
        "--max-queued-requests", str(MAX_QUEUED),
        # The whole line to one key: the burst (one key) overflows the shared line (503).
        "--max-queued-per-tenant", str(MAX_QUEUED),
        "--request-timeout-seconds", str(REQUEST_TIMEOUT_SECONDS),
    )  # fmt: skip
    with log.open("w") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
    soak = Soak(popen, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        await asyncio.to_thread(wait_until_up, popen, f"{soak.client.base_url}/ready", 300, log)
        rounds, resident = [], []
        for number in (1, 2):
            before = await soak.scrape()
            started = time.monotonic()
            result = await soak.run_round(number, key_file, redis_server)
            elapsed = time.monotonic() - started
            after = await soak.scrape()
            rounds.append(result)
            resident.append(_resident_mb(popen.pid))
            sent = BURST + MIXED
            completions = _requests_by_status(after, "/v1/completions") - _requests_by_status(
                before, "/v1/completions"
            )
            chat = _requests_by_status(after, "/v1/chat/completions") - _requests_by_status(
                before, "/v1/chat/completions"
            )
            print(
                f"\nround {number}: {sent} requests in {elapsed:.1f} s, outcomes "
                f"{dict(result.outcomes)}; server counted /v1/completions {dict(completions)}, "
                f"/v1/chat/completions {dict(chat)}, refusals by reason "
                f"{dict(_refused(after) - _refused(before))}; resident memory: server "
                f"{resident[-1][0]:.0f} MiB, with engine processes {resident[-1][1]:.0f} MiB"
            )
            assert sum(result.outcomes.values()) == sent
            assert set(result.outcomes) <= {"done", "429", "503", "504", "hung up"}
            assert completions == result.completions_statuses
            assert chat.total() == result.chat_requests
            # Each hostile kind happened (the burst alone guarantees 503 and 504).
            for kind in ("done", "429", "503", "504", "hung up"):
                assert result.outcomes[kind] > 0, (kind, result.outcomes)
        assert popen.poll() is None
        (server_1, total_1), (server_2, total_2) = resident
        growth = (
            f"server {server_2 / server_1:.3f}x, with engine processes {total_2 / total_1:.3f}x"
        )
        print(f"resident memory after round 2 over after round 1: {growth}")
        assert server_2 <= 1.05 * server_1 and total_2 <= 1.05 * total_1, growth
        assert "Traceback" not in log.read_text()
    finally:
        await soak.client.aclose()
        if popen.poll() is None:
            for child in psutil.Process(popen.pid).children(recursive=True):
                child.kill()
            popen.kill()
            popen.wait()
        redis_server.stop()
