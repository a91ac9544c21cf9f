"""Schemathesis fuzzes the server against its own OpenAPI document.

Valid and invalid bodies are generated, and every check runs but two whose
premise does not hold here: `positive_data_acceptance`, because some rules
span fields (`top_logprobs` needs `logprobs`, `best_of` must equal `n`,
`stream_options` needs `stream`), which the schema cannot express, so
schema-valid bodies can rightly get a 400; and `negative_data_rejection`,
because a body "broken" in one branch of a union (a prompt's token list made
a number) is often valid in another, and rightly accepted. The case count is
printed (run with `-s`).
"""

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import uvicorn

from server.app import create_app
from tests.net import free_port
from tests.unit.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.fuzz

REPO = Path(__file__).resolve().parents[2]


async def test_fuzzed_requests_get_no_5xx_and_no_schema_violations() -> None:
    port = free_port()
    app = create_app(ScriptedEngine(max_model_len=512))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    command = [
        str(Path(sys.executable).with_name("st")), "run",
        f"http://127.0.0.1:{port}/openapi.json",
        "--checks", "all",
        "--exclude-checks", "positive_data_acceptance,negative_data_rejection",
        "--max-examples", "100", "--seed", "1", "--workers", "1",
    ]  # fmt: skip
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SCHEMATHESIS_HOOKS": "tests.unit.schemathesis_hooks",
    }
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            command,
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        server.should_exit = True
        await task
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    cases = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
    assert cases is not None, result.stdout[-2000:]
    assert cases.group(1) == cases.group(2)
    print(f"\nschemathesis: {cases.group(1)} cases, all passed")
