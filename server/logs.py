"""Log setup: one line per record, as text or as JSON, each carrying the
request id of the request it was written for ("-" outside requests).

uvicorn's loggers and Python's warnings write through the root handler set
here. vLLM configures its own loggers in every process it starts (the engine
core among them), from a dictConfig file when `VLLM_LOGGING_CONFIG_PATH` names
one: in JSON mode that file points them at the same JSON formatter. What no
logger formats (a spawned engine process's import-time warnings, before vLLM
configures it; torch's native warnings) is wrapped on its way out by
`route_stderr_as_json`, so every line of every process parses.
"""

import atexit
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

from server.api.request_id import RequestIdLogFilter

TEXT_FORMAT = "%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines that parse fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(log_format: Literal["text", "json"]) -> None:
    """Our, uvicorn's and Python's warning lines in `log_format`; in JSON, vLLM's too, in
    this process and in those it starts (set before they start)."""
    configure_root_logging(log_format)
    if log_format == "json":
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_vllm_json_config())


def configure_root_logging(log_format: Literal["text", "json"]) -> None:
    """This process's own lines (and Python's warnings) in `log_format`, nothing else."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)


def _vllm_json_config() -> Path:
    """A dictConfig file sending the `vllm` loggers to stderr through JsonFormatter."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {
            "json": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {"vllm": {"handlers": ["json"], "level": "INFO", "propagate": False}},
    }
    with tempfile.NamedTemporaryFile(
        "w", prefix="specserve-vllm-logging-", suffix=".json", delete=False
    ) as file:
        json.dump(config, file)
    path = Path(file.name)
    atexit.register(path.unlink, missing_ok=True)
    return path


def route_output_as_json() -> None:
    """From now on every line this process and its children (they inherit the descriptors)
    write to stdout or stderr comes out on stderr as one JSON object: a JSON line as it is,
    any other wrapped as a WARNING of logger "stderr" (what a server writes outside logging
    is nearly always one). A thread forwards the lines through a pipe to the real stderr; at
    exit, what the processes wrote is forwarded before the process ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    real_stderr = os.dup(2)
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = threading.Thread(
        target=_forward_as_json, args=(read_end, real_stderr), name="stderr-as-json", daemon=True
    )
    forwarder.start()

    def stop() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        # Our ends of the pipe close: the forwarder reads what is left, to the end.
        os.dup2(real_stderr, 1)
        os.dup2(real_stderr, 2)
        forwarder.join(timeout=_FORWARD_AT_EXIT_SECONDS)

    atexit.register(stop)


# At exit, how long the children (normally gone by then) may keep the pipe open.
_FORWARD_AT_EXIT_SECONDS = 2.0


def _forward_as_json(read_end: int, real_stderr: int) -> None:
    with open(read_end, "rb") as pipe:
        for raw in pipe:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line.strip():
                continue
            data = (_json_line(line) + "\n").encode()
            try:
                while data:
                    data = data[os.write(real_stderr, data) :]
            except OSError:
                pass  # stderr is gone: keep draining the pipe, or the writers would block


def _json_line(line: str) -> str:
    if line.startswith("{"):
        try:
            if isinstance(json.loads(line), dict):
                return line
        except ValueError:
            pass
    now = time.time()
    return json.dumps(
        {
            # As logging.Formatter.formatTime writes it.
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
            + f",{int(now * 1000) % 1000:03d}",
            "level": "WARNING",
            "logger": "stderr",
            "request_id": "-",
            "message": line,
        }
    )
