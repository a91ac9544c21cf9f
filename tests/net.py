"""Loopback helpers shared by tests that start real servers."""

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_up(
    process: subprocess.Popen[Any], url: str, timeout_seconds: float, log: Path | None = None
) -> None:
    """Poll `url` until it answers 200; fail if `process` exits or time runs out."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        tail = log.read_text()[-3000:] if log is not None else ""
        assert process.poll() is None, f"server exited with {process.returncode}: {tail}"
        assert time.monotonic() < deadline, f"{url} did not answer 200: {tail}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(1)


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, seconds: float) -> None:
    """Wait up to `seconds` for `check` to hold; the bound only stops a hang."""
    for _ in range(round(seconds * 10)):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} within {seconds:g} s")
