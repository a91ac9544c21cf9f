"""--log-format json end to end in a real process: what loggers write, what Python warns,
what is printed or written straight to the descriptors, by the process and by its children,
all comes out as JSON lines on stderr."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, os, subprocess, sys, warnings
from server.logs import configure_logging, route_output_as_json
configure_logging("json")
route_output_as_json()
logging.getLogger("app").warning("from a logger")
print("printed")
warnings.warn("careful")
os.write(2, b"[W1201 12:00:00.000 native.cpp:1] raw\\n")
child = "import sys; print('child out'); print('child err', file=sys.stderr)"
subprocess.run([sys.executable, "-c", child], check=True)
"""


def test_json_output_wraps_what_no_logger_formatted_in_the_process_and_its_children() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    loggers = {line["message"]: line["logger"] for line in lines}
    assert loggers["from a logger"] == "app"
    for raw in ("printed", "[W1201 12:00:00.000 native.cpp:1] raw", "child out", "child err"):
        assert loggers[raw] == "stderr"
    (warned,) = [line for line in lines if line["logger"] == "py.warnings"]
    assert "UserWarning: careful" in warned["message"]
    assert all(set(line) >= {"time", "level", "logger", "request_id", "message"} for line in lines)
