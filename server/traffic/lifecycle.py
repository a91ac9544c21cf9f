"""The server's life: loading, ready, draining, stopped; and why it stops.

The app reads it to answer /ready and to refuse new generation requests
while draining; the engine watchdog marks the engine dead; the process
runner (server/traffic/runner.py) turns a stop request into uvicorn's shutdown and
the exit status.
"""

import asyncio
import logging

from server.engine.contract import Engine
from server.traffic.admission_queue import AdmissionController

logger = logging.getLogger(__name__)

# How often the watchdog asks the engine whether it is alive.
ENGINE_CHECK_SECONDS = 2.0
_DRAIN_POLL_SECONDS = 0.1


class Lifecycle:
    def __init__(self) -> None:
        self.loaded = False
        self.draining = False
        self.engine_failed = False
        self.stop_requested = asyncio.Event()

    @property
    def exit_status(self) -> int:
        """Non-zero when the engine died, so an orchestrator restarts us."""
        return 1 if self.engine_failed else 0

    async def drain(self, admission: AdmissionController, timeout_seconds: float) -> None:
        """Refuse new work, let admitted requests (running and queued) finish
        for up to `timeout_seconds`, then ask the process to stop."""
        self.draining = True
        logger.info(
            "draining: %d running and %d queued requests, up to %g s",
            admission.running,
            admission.queued,
            timeout_seconds,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while not admission.idle and loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_SECONDS)
        if admission.idle:
            logger.info("drained: every admitted request finished")
        else:
            logger.warning(
                "drain timeout: stopping with %d running and %d queued requests",
                admission.running,
                admission.queued,
            )
        self.stop_requested.set()

    async def watch_engine(self, engine: Engine) -> None:
        """Stop the process, with a failure status, once the engine is dead."""
        while await engine.check_health():
            await asyncio.sleep(ENGINE_CHECK_SECONDS)
        logger.error("the engine died; stopping so the process can be restarted")
        self.engine_failed = True
        self.stop_requested.set()
