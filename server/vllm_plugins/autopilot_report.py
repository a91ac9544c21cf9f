"""Speculation reports from vLLM's engine processes to specserve's front end (the sending
side, in EngineCore and the workers).

The scheduler (EngineCore process) and the draft proposer (worker process)
run outside the front end, which owns /metrics. Each sends its cumulative
totals as one JSON datagram over a Unix socket whose path the engine puts in
its settings for vLLM's processes (`patching.report_socket()`).
Sending never blocks an engine step: when the front end is behind, the report
stays pending and the next one carries the newer totals (they are cumulative,
so nothing is lost).
The front end's receiving side is `server.engine.autopilot_feed`.
"""

import json
import socket
from collections.abc import Mapping


class Reporter:
    """Sends `{"source": name, **totals}` to the socket at `path` (none: nowhere)."""

    def __init__(self, source: str, path: str | None) -> None:
        self._source = source
        self._path = path or ""
        self._socket: socket.socket | None = None
        if self._path:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.setblocking(False)
        self._unsent: bytes | None = None

    def send(self, totals: Mapping[str, object]) -> None:
        if self._socket is None:
            return
        self._unsent = json.dumps({"source": self._source, **totals}).encode()
        self.flush()

    def flush(self) -> None:
        """Retry a report the front end had no room for."""
        if self._socket is None or self._unsent is None:
            return
        try:
            self._socket.sendto(self._unsent, self._path)
        except (BlockingIOError, FileNotFoundError, ConnectionRefusedError):
            return
        self._unsent = None
