"""The agent workload's tasks: a coding agent reads a file, rewrites it, runs its tests, fixes
what they report and runs them again.

The files are copies of this repository's own (loadtest/records.py, loadtest/sse.py,
server/api/request_id.py, server/traffic/lifecycle.py as of commit 6d0dd7f), frozen so that
the workload, and the benchmark records made with it, stay the same when the code changes.
The tests' outputs are made up for the tasks, in pytest's format.
"""

from dataclasses import dataclass

Edit = tuple[tuple[str, str], ...]  # (old, new) replacements, each old found exactly once


@dataclass(frozen=True)
class Task:
    name: str
    request: str  # what the user asks
    path: str
    source: str  # the file as the agent reads it
    first_edit: Edit  # the agent's first attempt, which the tests fail
    tests: str  # the pytest selector it runs
    failure: str  # what the tests print after the first attempt
    fix: Edit  # in the first attempt: what makes them pass
    passed: str  # what they print then

    def attempts(self) -> tuple[str, str]:
        """The file after the first attempt and after the fix."""
        first = _apply(self.source, self.first_edit)
        return first, _apply(first, self.fix)


def _apply(text: str, edit: Edit) -> str:
    for old, new in edit:
        if text.count(old) != 1:
            raise ValueError(f"edit of {old!r}: found {text.count(old)} times, not once")
        text = text.replace(old, new)
    return text


def _pytest(tests: str, body: str) -> str:
    return f"$ python -m pytest -q --tb=short {tests}\n{body}"


_RECORDS = r'''"""What one request did, as the load generator saw it.

Times are `time.perf_counter()` seconds. `start` is relative to the start of
the run; the others are durations from the moment the request was sent.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass
class RequestRecord:
    index: int  # position in the run's request sequence
    item: str  # workload item id, so runs against two servers pair up
    server: str  # label of the server it went to
    start: float = 0.0
    success: bool = False
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None
    ttft: float | None = None  # sent -> first chunk carrying generated text
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    e2el: float | None = None  # sent -> last text chunk (whole response if not streamed)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt's, reused from the server's prefix cache
    output_tokens: int = 0
    # "usage" when the server reported the count; "chunks" when it did not and
    # every text chunk counted as one token (an undercount with speculation).
    output_tokens_source: Literal["usage", "chunks"] = "usage"
    speculation: dict[str, Any] | None = None  # the server's per-request summary, if any
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); undefined below two tokens."""
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tpot"] = self.tpot
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RequestRecord":
        data = {k: v for k, v in data.items() if k != "tpot"}
        return cls(**data)
'''

_SSE = r'''"""Incremental Server-Sent Events parsing for OpenAI-style streams.

Network reads split events anywhere (mid-line, mid-CRLF, between the two
newlines that end an event), so bytes are buffered until a blank line ends
an event. Only `data:` fields matter for OpenAI streams; comments (`:` lines,
often keep-alive pings) and other fields are skipped. Multi-line data joins
with newlines, as the SSE spec says.
A UTF-8 character split across two reads is decoded once both halves are in.
"""

import codecs


class SSEParser:
    """Feed raw bytes, get the data payload of each completed event."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._pending_cr = False
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes | str) -> list[str]:
        text = self._decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        if self._pending_cr and text.startswith("\n"):
            # The CR that ended the previous read was the first half of a CRLF.
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        events: list[str] = []
        while True:
            line, sep, rest = _split_line(self._buffer)
            if not sep:
                break
            self._buffer = rest
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        """End of stream: an event not followed by a blank line still counts."""
        events = self.feed("\n\n") if (self._buffer or self._data) else []
        return events


def _split_line(buffer: str) -> tuple[str, str, str]:
    """First line of `buffer` and the rest; lines end with CRLF, LF or CR."""
    for index, char in enumerate(buffer):
        if char == "\n":
            return buffer[:index], "\n", buffer[index + 1 :]
        if char == "\r":
            if index + 1 < len(buffer) and buffer[index + 1] == "\n":
                return buffer[:index], "\r\n", buffer[index + 2 :]
            return buffer[:index], "\r", buffer[index + 1 :]
    return buffer, "", ""
'''

_REQUEST_ID = r'''"""X-Request-Id: accepted from the client or generated, returned on every
response, and stamped on every log line written while the request runs."""

import logging
import re
import uuid
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# Client ids end up in logs: accept short, plain ones only.
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
current_request_id: ContextVar[str] = ContextVar("request_id", default="-")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER.encode(), b"").decode("latin-1")
        request_id = given if _VALID.fullmatch(given) else uuid.uuid4().hex
        token = current_request_id.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class RequestIdLogFilter(logging.Filter):
    """Adds `request_id` to every record ("-" outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True
'''

_LIFECYCLE = r'''"""The server's life: loading, ready, draining, stopped; and why it stops.

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
'''


_FAILURES = "=" * 35 + " FAILURES " + "=" * 35
_SUMMARY = "=" * 27 + " short test summary info " + "=" * 28

TASKS = [
    Task(
        name="records",
        request="Add an `output_throughput` property to `RequestRecord` in loadtest/records.py: "
        "the request's output tokens per second over its E2EL, None for a failed request. "
        "Write it into `to_json` next to `tpot`. Run tests/loadtest/test_records.py when done.",
        path="loadtest/records.py",
        source=_RECORDS,
        first_edit=(
            (
                "        return (self.e2el - self.ttft) / (self.output_tokens - 1)\n",
                "        return (self.e2el - self.ttft) / (self.output_tokens - 1)\n\n"
                "    @property\n"
                "    def output_throughput(self) -> float | None:\n"
                '        """Output tokens per second over E2EL; None for a failed request."""\n'
                "        if not self.success or not self.e2el:\n"
                "            return None\n"
                "        return self.output_tokens / self.e2el\n",
            ),
            (
                '        data["tpot"] = self.tpot\n',
                '        data["tpot"] = self.tpot\n'
                '        data["output_throughput"] = self.output_throughput\n',
            ),
        ),
        tests="tests/loadtest/test_records.py",
        failure=_pytest(
            "tests/loadtest/test_records.py",
            "..F..                                                                    [100%]\n"
            f"{_FAILURES}\n"
            "____________________________ test_json_round_trip ______________________________\n"
            "tests/loadtest/test_records.py:27: in test_json_round_trip\n"
            "    assert RequestRecord.from_json(record.to_json()) == record\n"
            "loadtest/records.py:55: in from_json\n"
            "    return cls(**data)\n"
            "E   TypeError: RequestRecord.__init__() got an unexpected keyword argument "
            "'output_throughput'\n"
            f"{_SUMMARY}\n"
            "FAILED tests/loadtest/test_records.py::test_json_round_trip - TypeError: Reque...\n"
            "1 failed, 4 passed in 0.05s\n",
        ),
        fix=(
            (
                '        data = {k: v for k, v in data.items() if k != "tpot"}\n',
                '        data = {k: v for k, v in data.items() if k not in ("tpot", '
                '"output_throughput")}\n',
            ),
        ),
        passed=_pytest(
            "tests/loadtest/test_records.py",
            ".....                                                                    [100%]\n"
            "5 passed in 0.04s\n",
        ),
    ),
    Task(
        name="sse",
        request="Streams from some servers carry keep-alive comments (`: ping`). Make "
        "`SSEParser` in loadtest/sse.py count the comment lines it skips, in a `comments` "
        "attribute, so the client can report them. Run tests/loadtest/test_sse.py afterwards.",
        path="loadtest/sse.py",
        source=_SSE,
        first_edit=(
            (
                '            if line.startswith(":"):\n                continue\n',
                '            if line.startswith(":"):\n'
                "                self.comments += 1\n"
                "                continue\n",
            ),
        ),
        tests="tests/loadtest/test_sse.py",
        failure=_pytest(
            "tests/loadtest/test_sse.py",
            "......F                                                                  [100%]\n"
            f"{_FAILURES}\n"
            "__________________________ test_comments_are_counted ___________________________\n"
            "tests/loadtest/test_sse.py:71: in test_comments_are_counted\n"
            '    assert parser.feed(b": ping\\n\\ndata: {}\\n\\n") == ["{}"]\n'
            "loadtest/sse.py:42: in feed\n"
            "    self.comments += 1\n"
            "E   AttributeError: 'SSEParser' object has no attribute 'comments'\n"
            f"{_SUMMARY}\n"
            "FAILED tests/loadtest/test_sse.py::test_comments_are_counted - AttributeError:...\n"
            "1 failed, 6 passed in 0.06s\n",
        ),
        fix=(
            (
                '        self._decoder = codecs.getincrementaldecoder("utf-8")()\n',
                '        self._decoder = codecs.getincrementaldecoder("utf-8")()\n'
                "        self.comments = 0  # comment lines skipped: keep-alive pings\n",
            ),
        ),
        passed=_pytest(
            "tests/loadtest/test_sse.py",
            ".......                                                                  [100%]\n"
            "7 passed in 0.05s\n",
        ),
    ),
    Task(
        name="request-id",
        request="A client's X-Request-Id longer than 128 characters is replaced by a fresh id, "
        "and the client then cannot find its request in our logs. Keep the first 64 "
        "characters of a long id instead, and accept ids of at most 64 characters. The "
        "middleware is server/api/request_id.py; run tests/unit/test_request_id.py.",
        path="server/api/request_id.py",
        source=_REQUEST_ID,
        first_edit=(
            ("{1,128}", "{1,64}"),
            (
                "        request_id = given if _VALID",
                "        request_id = given[:64] if _VALID",
            ),
        ),
        tests="tests/unit/test_request_id.py",
        failure=_pytest(
            "tests/unit/test_request_id.py",
            "...F.                                                                    [100%]\n"
            f"{_FAILURES}\n"
            "_________________ test_a_long_id_keeps_its_first_64_characters _________________\n"
            "tests/unit/test_request_id.py:48: in test_a_long_id_keeps_its_first_64_characters\n"
            '    assert response.headers["x-request-id"] == "a" * 64\n'
            "E   AssertionError: assert '9b1f0c2e7d4a4f0e8c51a3b6d2e7f901' == 'aaaaaaaaaaaa...'\n"
            "E     - aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n"
            "E     + 9b1f0c2e7d4a4f0e8c51a3b6d2e7f901\n"
            f"{_SUMMARY}\n"
            "FAILED tests/unit/test_request_id.py::test_a_long_id_keeps_its_first_64_charac...\n"
            "1 failed, 4 passed in 0.31s\n",
        ),
        fix=(
            (
                '.decode("latin-1")\n        request_id = given[:64] if',
                '.decode("latin-1")[:64]\n        request_id = given if',
            ),
        ),
        passed=_pytest(
            "tests/unit/test_request_id.py",
            ".....                                                                    [100%]\n"
            "5 passed in 0.29s\n",
        ),
    ),
    Task(
        name="lifecycle",
        request="`Lifecycle.drain` in server/traffic/lifecycle.py polls the admission every "
        "0.1 s, which makes tests/unit/test_lifecycle.py slow. Give `drain` a `poll_seconds` "
        "parameter that defaults to the current interval, then run that test file.",
        path="server/traffic/lifecycle.py",
        source=_LIFECYCLE,
        first_edit=(
            (
                "    async def drain(self, admission: AdmissionController, timeout_seconds: float)"
                " -> None:\n",
                "    async def drain(\n"
                "        self,\n"
                "        admission: AdmissionController,\n"
                "        timeout_seconds: float,\n"
                "        poll_seconds: float = _DRAIN_POLL_SECONDS,\n"
                "    ) -> None:\n",
            ),
        ),
        tests="tests/unit/test_lifecycle.py",
        failure=_pytest(
            "tests/unit/test_lifecycle.py",
            ".F..                                                                     [100%]\n"
            f"{_FAILURES}\n"
            "____________________ test_drain_polls_at_the_given_interval ____________________\n"
            "tests/unit/test_lifecycle.py:52: in test_drain_polls_at_the_given_interval\n"
            "    assert sleeps == [0.01, 0.01, 0.01]\n"
            "E   assert [0.1, 0.1, 0.1] == [0.01, 0.01, 0.01]\n"
            "E     At index 0 diff: 0.1 != 0.01\n"
            "E     Use -v to get more diff\n"
            f"{_SUMMARY}\n"
            "FAILED tests/unit/test_lifecycle.py::test_drain_polls_at_the_given_interval - ...\n"
            "1 failed, 3 passed in 0.12s\n",
        ),
        fix=(
            (
                "await asyncio.sleep(_DRAIN_POLL_SECONDS)",
                "await asyncio.sleep(poll_seconds)",
            ),
        ),
        passed=_pytest(
            "tests/unit/test_lifecycle.py",
            "....                                                                     [100%]\n"
            "4 passed in 0.05s\n",
        ),
    ),
]
