"""Runs the app under uvicorn as a well-behaved process.

The first SIGTERM or SIGINT drains: /ready turns 503 at once, new generation
requests get 503, admitted ones finish for up to the drain timeout, then
uvicorn shuts down and the process exits 0. uvicorn alone would stop
listening at once and re-raise the signal after shutdown (exit status 143).
A second signal stops at once. A dead engine stops the process with status 1.
SIGHUP reloads the API key file (which is also polled for changes).
"""

import asyncio
import logging
import signal
import socket
from collections.abc import Coroutine
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from server.config import ConfigError
from server.traffic.admission_queue import AdmissionController
from server.traffic.api_keys import ApiKeys
from server.traffic.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

# What is left after the drain (probes, streams cut by the drain timeout)
# gets this long before uvicorn cancels it.
_AFTER_DRAIN_SECONDS = 2


class _DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        lifecycle: Lifecycle,
        admission: AdmissionController,
        drain_timeout_seconds: float,
        api_keys: ApiKeys | None,
    ) -> None:
        super().__init__(config)
        self._lifecycle = lifecycle
        self._admission = admission
        self._drain_timeout_seconds = drain_timeout_seconds
        self._api_keys = api_keys
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._start(self._stop_when_requested())
        # Without a handler SIGHUP would kill the process; with no key file it only logs.
        self._loop.add_signal_handler(signal.SIGHUP, self._reload_keys)
        if self._api_keys is not None:
            self._start(self._api_keys.watch())
        await super().serve(sockets)

    def _reload_keys(self) -> None:
        logger.info("received SIGHUP: reloading the API key file")
        if self._api_keys is None:
            logger.info("no --api-key-file: nothing to reload")
        else:
            self._api_keys.reload()

    async def _stop_when_requested(self) -> None:
        await self._lifecycle.stop_requested.wait()
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._lifecycle.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        # Set here, in the signal handler, so /ready is 503 from now on.
        self._lifecycle.draining = True
        self._loop.call_soon_threadsafe(
            self._start, self._lifecycle.drain(self._admission, self._drain_timeout_seconds)
        )

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)  # a running task needs a strong reference
        task.add_done_callback(self._tasks.discard)


def bind_listeners(host: str, port: int, metrics_port: int | None) -> list[socket.socket]:
    """The API socket and, with a `metrics_port`, the metrics one, bound before anything
    loads: a port already taken stops the server at once, naming the flag that set it."""
    listeners: list[socket.socket] = []
    for flag, number in (("--port", port), ("--metrics-port", metrics_port)):
        if number is None:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, number))
        except OSError as exc:
            listener.close()
            for bound in listeners:
                bound.close()
            raise ConfigError(
                f"cannot listen on {host}:{number} ({flag} {number}): {exc.strerror}; "
                f"give another {flag}"
            ) from None
        listeners.append(listener)
    return listeners


def run(
    app: FastAPI,
    *,
    listeners: list[socket.socket],
    lifecycle: Lifecycle,
    admission: AdmissionController,
    drain_timeout_seconds: float,
    max_connections: int,
    keep_alive_timeout_seconds: int,
    api_keys: ApiKeys | None = None,
) -> int:
    """Serve on `listeners` (from `bind_listeners`) until drained or the engine dies; return
    the exit status. One server listens on the API and metrics sockets (the app tells them
    apart); `api_keys` reload from their file on SIGHUP and when it changes."""
    # log_config=None: uvicorn's loggers (access log included) go through the
    # root handler, so every line carries the request id.
    config = uvicorn.Config(
        app,
        log_level="info",
        log_config=None,
        timeout_graceful_shutdown=_AFTER_DRAIN_SECONDS,
        limit_concurrency=max_connections,
        timeout_keep_alive=keep_alive_timeout_seconds,
    )
    server = _DrainingServer(config, lifecycle, admission, drain_timeout_seconds, api_keys)
    server.run(listeners)
    return lifecycle.exit_status
