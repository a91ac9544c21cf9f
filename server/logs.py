"""Log setup: one line per record, as text or as JSON, each carrying the
request id of the request it was written for ("-" outside requests)."""

import json
import logging
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
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdLogFilter())
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
