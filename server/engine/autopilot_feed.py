"""The front end's view of the speculation autopilot, fed by the engine processes (API
process).

Binds the Unix datagram socket that `server.vllm_plugins.autopilot_report` sends to,
keeps the latest cumulative report of each source (the scheduler, the draft
worker, each engine process's failed vLLM patches), and turns them into the
autopilot's Prometheus series. A datagram it cannot read whole (over
`reports.MAX_REPORT_BYTES`, not JSON, not a report) is dropped and counted, as are the
reports the senders counted dropped (`specserve_autopilot_reports_dropped_total`); the next
report carries the totals again. Serving code asks it which K=0 reasons applied
while a request ran. No vLLM import.
"""

import asyncio
import json
import logging
import os
import socket
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, cast

from server import metrics
from server.autopilot.reports import MAX_REPORT_BYTES, DraftReport, SchedulerReport

logger = logging.getLogger(__name__)


class AutopilotFeed:
    """Latest totals per source, read whenever the socket has data."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._dir = tempfile.mkdtemp(prefix="specserve-autopilot-")
        self.path = str(Path(self._dir) / "reports.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self.path)
        self._socket.setblocking(False)
        self._latest: dict[str, dict[str, Any]] = {}
        self._counted: dict[tuple[str, str], float] = {}
        self._unreadable = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.fileno(), self.drain)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._socket.fileno())
        self._socket.close()
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self._dir)

    def drain(self) -> None:
        """Read every pending report (also called before reading the totals,
        so a request that just finished sees the reports of its last step)."""
        while True:
            try:
                # One byte more than a report may hold: a longer datagram shows, truncated.
                data = self._socket.recv(MAX_REPORT_BYTES + 1)
            except OSError:  # BlockingIOError: nothing pending
                return
            report = _report(data)
            if report is None:
                if not self._unreadable:
                    logger.warning("autopilot: an unreadable report dropped (and counted)")
                self._unreadable += 1
                metrics.AUTOPILOT_REPORTS_DROPPED.labels(self._model, "unreadable").inc()
                continue
            self._latest[report["source"]] = report
            self._publish(report)

    def scheduler(self) -> dict[str, Any]:
        self.drain()
        return self._latest.get("scheduler", {})

    def draft(self) -> dict[str, Any]:
        self.drain()
        return self._latest.get("draft", {})

    def draft_head(self) -> dict[str, Any]:
        self.drain()
        return self._latest.get("draft_head", {})

    def idle_reasons(self) -> Counter[str]:
        """K=0 steps so far, by reason; a request diffs two of these."""
        return Counter(self.scheduler().get("zero_steps_by_reason", {}))

    def _publish(self, report: dict[str, Any]) -> None:
        source = report["source"]
        dropped = metrics.AUTOPILOT_REPORTS_DROPPED.labels(self._model, "unsent")
        self._count(dropped, ("dropped", source), report.get("dropped_reports", 0))
        if source == "scheduler":
            self._publish_scheduler(cast(SchedulerReport, report))
        elif source == "draft":
            self._publish_draft(cast(DraftReport, report))
        elif source.startswith("patch_failures:"):
            # One report source per engine process; each patch fails at most once in one.
            for patch in report["failed"]:
                child = metrics.VLLM_PATCH_FAILURES.labels(self._model, patch)
                self._count(child, (source, patch), 1)

    def _publish_scheduler(self, report: SchedulerReport) -> None:
        model = self._model
        metrics.SPECULATION_K_IN_FORCE.labels(model).set(report["k"])
        metrics.SPECULATION_PREDICTED_SPEEDUP.labels(model).set(report["predicted_speedup"])
        measured = report.get("measured_speedup")
        if measured is not None:
            metrics.SPECULATION_MEASURED_SPEEDUP.labels(model).set(measured)
        for k, steps in report["steps_by_k"].items():
            self._count(metrics.SPECULATION_STEPS.labels(model, k), ("k", k), steps)
        for reason, steps in report["zero_steps_by_reason"].items():
            child = metrics.SPECULATION_IDLE_STEPS.labels(model, reason)
            self._count(child, ("reason", reason), steps)
        for source, counts in report.get("verified_by_source", {}).items():
            child = metrics.SPEC_SOURCE_DRAFT_TOKENS.labels(model, source)
            self._count(child, ("source_verified", source), counts["verified"])
            child = metrics.SPEC_SOURCE_ACCEPTED_TOKENS.labels(model, source)
            self._count(child, ("source_accepted", source), counts["accepted"])
        if "lookup_index_tokens" in report:
            metrics.LOOKUP_INDEX_TOKENS.labels(model).set(report["lookup_index_tokens"])

    def _publish_draft(self, report: DraftReport) -> None:
        model = self._model
        passes = report["draft_forward_passes"]
        self._count(metrics.DRAFT_FORWARD_PASSES.labels(model), ("passes", ""), passes)
        caught_up = report["draft_caught_up_tokens"]
        self._count(metrics.DRAFT_CAUGHT_UP_TOKENS.labels(model), ("caught_up", ""), caught_up)

    def _count(self, child: Any, key: tuple[str, str], total: float) -> None:
        """Counters move by the growth of the engine's cumulative total."""
        growth = total - self._counted.get(key, 0)
        if growth > 0:
            child.inc(growth)
            self._counted[key] = total


def _report(data: bytes) -> dict[str, Any] | None:
    """A datagram as a report: a JSON object naming its source, whole (None: unreadable)."""
    if len(data) > MAX_REPORT_BYTES:
        return None
    try:
        report = json.loads(data)
    except ValueError:
        return None
    if not isinstance(report, dict) or not isinstance(report.get("source"), str):
        return None
    return report
