"""`specserve serve` as a real process on tiny models: SIGTERM drains, a dead
engine exits non-zero, SIGHUP rotates the API keys under a running stream (and
with --log-format json every line the processes log is JSON).

Timings are printed (run with `-s` to see them); nothing asserts on speed.
"""

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import ServerProcess, TinyModels, serving
from tests.net import wait_until

pytestmark = pytest.mark.integration

# Outlasts the signal by several seconds on the tiny model (600 tokens).
LONG_TOKENS = 600
LONG_BODY = {"model": "tiny", "prompt": "x", "max_tokens": LONG_TOKENS, "temperature": 0}


@pytest.fixture
def serve_process(tiny: TinyModels, tmp_path: Path) -> Iterator[ServerProcess]:
    # Every interface, open by choice: the flag that lifts the refusal works.
    with serving(tiny, tmp_path, "--host", "0.0.0.0", "--allow-unauthenticated") as process:
        yield process


async def _stream(
    client: httpx.AsyncClient, started: asyncio.Event, max_tokens: int = LONG_TOKENS
) -> list[dict[str, object]]:
    events = []
    body = {**LONG_BODY, "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return events
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                started.set()
    raise AssertionError("stream ended without [DONE]")


async def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(
    serve_process: ServerProcess,
) -> None:
    async with httpx.AsyncClient(base_url=serve_process.base_url, timeout=300) as client:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(_stream(client, event)) for event in started]
        plain = asyncio.create_task(client.post("/v1/completions", json=LONG_BODY))
        for event in started:
            await asyncio.wait_for(event.wait(), timeout=60)

        # /metrics is on its own port only.
        assert (await client.get("/metrics")).status_code == 404

        async def all_admitted() -> bool:
            text = (await client.get(serve_process.metrics_url)).text
            return "specserve_requests_running 3.0" in text.splitlines()

        async def not_ready() -> bool:
            return (await client.get("/ready")).status_code == 503

        # The plain request too holds its slot before the signal, however
        # soon the streams' first tokens came.
        await wait_until(all_admitted, "the three requests were not all admitted", 120)
        signalled = time.monotonic()
        serve_process.popen.send_signal(signal.SIGTERM)
        await wait_until(not_ready, "/ready did not turn 503 after SIGTERM", 120)
        assert (await client.get("/health")).status_code == 200
        refused = await client.post("/v1/completions", json={**LONG_BODY, "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert "retry-after" in refused.headers
        assert not any(stream.done() for stream in streams), "requests ended before the drain"
        results = await asyncio.gather(*streams)
        plain_response = await plain
        drained = time.monotonic()
    for events in results:
        assert all("error" not in event for event in events)
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert plain_response.status_code == 200
    assert plain_response.json()["usage"]["completion_tokens"] == LONG_BODY["max_tokens"]
    exit_status = await asyncio.to_thread(serve_process.popen.wait, 60)
    exited = time.monotonic()
    assert exit_status == 0, serve_process.log.read_text()[-3000:]
    print(
        f"\ndrain: in-flight requests finished {drained - signalled:.1f} s after SIGTERM, "
        f"process exited {exited - signalled:.1f} s after it"
    )


def test_a_dead_engine_turns_health_503_and_exits_non_zero(serve_process: ServerProcess) -> None:
    engine_cores = _engine_cores(serve_process)
    killed = time.monotonic()
    for core in engine_cores:
        os.kill(core.pid, signal.SIGKILL)
    unhealthy = serve_process.dies_with_its_engine(60)
    print(
        f"\nengine killed: exit status 1 after {time.monotonic() - killed:.1f} s, "
        f"/health seen 503: {unhealthy}"
    )


def _write_keys(path: Path, key: str) -> None:
    path.write_text(json.dumps({"keys": [{"key": key, "tenant": "team"}]}))


async def test_sighup_rotates_the_keys_and_leaves_running_streams_alone(
    tiny: TinyModels, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys.json"
    _write_keys(key_file, "sk-before")
    flags = ("--host", "127.0.0.1", "--api-key-file", str(key_file), "--log-format", "json")
    with serving(tiny, tmp_path, *flags) as process:
        async with httpx.AsyncClient(base_url=process.base_url, timeout=300) as client:

            async def status(key: str) -> int:
                headers = {"Authorization": f"Bearer {key}"}
                return (await client.get("/v1/models", headers=headers)).status_code

            client.headers["Authorization"] = "Bearer sk-before"
            started = asyncio.Event()
            # Near the context length: still running when the keys change.
            stream = asyncio.create_task(_stream(client, started, max_tokens=1900))
            await asyncio.wait_for(started.wait(), timeout=60)
            _write_keys(key_file, "sk-after")
            process.popen.send_signal(signal.SIGHUP)

            async def rotated() -> bool:
                return await status("sk-after") == 200

            await wait_until(rotated, "the new key was not accepted after SIGHUP", 60)
            assert not stream.done(), "the stream ended before the rotation"
            assert await status("sk-before") == 401
            key_file.write_text("not json")
            process.popen.send_signal(signal.SIGHUP)

            async def refused_logged() -> bool:
                return "previous keys stay in force" in process.log.read_text()

            await wait_until(refused_logged, "the bad key file was not reported", 60)
            assert await status("sk-after") == 200
            events = await stream
        assert process.popen.poll() is None
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert all("error" not in event for event in events)
    # --log-format json: every line, vLLM's engine processes' included, is JSON.
    lines = [line for line in process.log.read_text().splitlines() if line.strip()]
    not_json = [line for line in lines if not _is_json_object(line)]
    assert not not_json, not_json[:20]
    loggers = {json.loads(line)["logger"] for line in lines}
    assert {"server.traffic.api_keys", "uvicorn.error"} <= loggers and any(
        name.startswith("vllm") for name in loggers
    ), loggers


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_the_rank_runs_with_the_openmp_binding_vllm_gives_a_worker(
    serve_process: ServerProcess,
) -> None:
    """One rank runs in the EngineCore's process, spawned with the OpenMP environment vLLM
    gives a CPU worker's process: one thread bound to each core of the binding (without it
    every thread may run on every core)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: a bound thread and an unbound one look alike")
    [engine_core] = _engine_cores(serve_process)
    bound = {tuple(sorted(os.sched_getaffinity(thread.id))) for thread in engine_core.threads()}
    assert all((core,) in bound for core in cores), bound


def _engine_cores(serve_process: ServerProcess) -> list[psutil.Process]:
    children = psutil.Process(serve_process.popen.pid).children(recursive=True)
    engine_cores = [c for c in children if "EngineCore" in " ".join(c.cmdline()) + c.name()]
    assert engine_cores, [(c.name(), c.cmdline()) for c in children]
    return engine_cores
