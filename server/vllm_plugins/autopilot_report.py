"""Speculation reports from vLLM's engine processes to specserve's front end (the sending
side, in EngineCore and the workers).

The scheduler (EngineCore process) and the draft proposer (worker process)
run outside the front end, which owns /metrics. Each sends its cumulative
totals as one JSON datagram over a Unix socket whose path the engine puts in
its settings for vLLM's processes (`patching.report_socket()`).
Sending never blocks an engine step and never raises into it: when the front end is
behind or not listening yet, the report stays pending and the next one carries the newer
totals (they are cumulative, so nothing is lost). A report that cannot be sent at all (over
`reports.MAX_REPORT_BYTES`, which the front end would not read whole, not encodable, or
refused by the socket) is dropped and counted; every report carries the sender's count
(`dropped_reports`), which the front end turns into
`specserve_autopilot_reports_dropped_total`.
The front end's receiving side is `server.engine.autopilot_feed`.
"""

import json
import logging
import socket
from collections.abc import Mapping

from server.autopilot.reports import MAX_REPORT_BYTES

logger = logging.getLogger(__name__)


class Reporter:
    """Sends `{"source": name, "dropped_reports": n, **totals}` to the socket at `path`
    (none: nowhere)."""

    def __init__(self, source: str, path: str | None) -> None:
        self._source = source
        self._path = path or ""
        self._socket: socket.socket | None = None
        if self._path:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.setblocking(False)
        self._unsent: bytes | None = None
        self.dropped = 0  # reports that could not be sent, since the process started

    def send(self, totals: Mapping[str, object]) -> None:
        if self._socket is None:
            return
        try:
            data = json.dumps(
                {"source": self._source, "dropped_reports": self.dropped, **totals}
            ).encode()
        except (TypeError, ValueError):
            self._drop("is not JSON")
            return
        if len(data) > MAX_REPORT_BYTES:
            self._drop(f"is {len(data)} bytes, over {MAX_REPORT_BYTES}")
            return
        self._unsent = data
        self.flush()

    def flush(self) -> None:
        """Retry a report the front end had no room for."""
        if self._socket is None or self._unsent is None:
            return
        try:
            self._socket.sendto(self._unsent, self._path)
        except (BlockingIOError, FileNotFoundError, ConnectionRefusedError):
            return  # the front end is behind or not listening: the next report supersedes it
        except OSError as exc:
            self._drop(f"was refused ({exc})")
        self._unsent = None

    def _drop(self, why: str) -> None:
        if not self.dropped:
            logger.warning("specserve: a %s report %s: dropped, and counted", self._source, why)
        self.dropped += 1
