"""Loopback helpers shared by tests that start real servers (starting one: loadtest/launch.py)."""

import asyncio
import socket
from collections.abc import Awaitable, Callable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, seconds: float) -> None:
    """Wait up to `seconds` for `check` to hold; the bound only stops a hang."""
    for _ in range(round(seconds * 10)):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} within {seconds:g} s")
