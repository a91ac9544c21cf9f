"""Starting a server process and knowing when it serves: the one helper the benchmarks, the
load tests and the test suite share."""

import contextlib
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx


class ServerStartError(RuntimeError):
    """The process exited, or its URL did not answer 200 in time (the message has its log's
    tail when there is a log)."""


def wait_until_up(
    process: subprocess.Popen[Any], url: str, timeout_seconds: float, log: Path | None = None
) -> float:
    """Poll `url` until it answers 200 and return the seconds waited; raise ServerStartError
    if `process` exits first or time runs out."""
    started = time.monotonic()
    while True:
        if process.poll() is not None or time.monotonic() - started > timeout_seconds:
            tail = log.read_text()[-3000:] if log is not None and log.is_file() else ""
            what = (
                f"exited with {process.returncode}"
                if process.poll() is not None
                else (f"did not answer 200 on {url} within {timeout_seconds:g} s")
            )
            raise ServerStartError(f"server {what}: {tail}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - started
        time.sleep(1)


def stop(process: subprocess.Popen[Any], timeout_seconds: float = 90) -> None:
    """SIGINT (the server drains and exits), then SIGKILL if it is still there."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
