"""deploy/prometheus against the real tools: promtool checks and unit tests, and
a real Prometheus scraping specserve whose recording rules must reproduce the
speculation figures the responses reported.

`make test` installs Debian's prometheus package (server and promtool).
"""

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.conftest import RunningServer
from tests.net import free_port

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make tools` installs Debian's prometheus package"
    return path


@pytest.mark.parametrize(
    "args",
    [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "rules.yml"],
        ["test", "rules", "rules_test.yml"],
    ],
)
def test_promtool_accepts_the_deploy_files(args: list[str]) -> None:
    result = subprocess.run(
        [_tool("promtool"), *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
async def prometheus(spec_server: RunningServer, tmp_path: Path) -> AsyncIterator[str]:
    """A Prometheus on loopback scraping `spec_server` every second with our rules."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DEPLOY / "rules.yml")]
    config["scrape_configs"][0]["static_configs"] = [
        {"targets": [spec_server.base_url.removeprefix("http://")]}
    ]
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        _tool("prometheus"), f"--config.file={config_file}",
        f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(100):
                try:
                    if (await http.get("/-/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("prometheus did not become ready")
        yield url
    finally:
        process.terminate()
        await process.wait()


async def _query(http: httpx.AsyncClient, expr: str) -> dict[str, float]:
    """Instant query; {position label or "": value}, one series per key."""
    body = (await http.get("/api/v1/query", params={"query": expr})).json()
    assert body["status"] == "success", body
    values = {r["metric"].get("position", ""): float(r["value"][1]) for r in body["data"]["result"]}
    assert len(values) == len(body["data"]["result"]), body
    return values


async def _wait_for(http: httpx.AsyncClient, expr: str, expected: dict[str, float]) -> None:
    last: dict[str, float] = {}
    for _ in range(60):
        last = await _query(http, expr)
        if last.keys() == expected.keys() and all(
            last[k] == pytest.approx(v, rel=1e-9) for k, v in expected.items()
        ):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{expr}: got {last}, expected {expected}")


async def test_recording_rules_reproduce_the_responses(
    spec_server: RunningServer, prometheus: str
) -> None:
    async with httpx.AsyncClient(base_url=prometheus, timeout=30) as prom:
        # A first scrape sees the counters before the workload.
        await _wait_for(prom, 'count(up{job="specserve"} == 1)', {"": 1.0})
        await asyncio.sleep(1.5)
        totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        per_position = [0, 0, 0]
        async with httpx.AsyncClient(base_url=spec_server.base_url, timeout=120) as http:
            for prompt in ("def add(a, b):", "The weather today", "import os\n"):
                response = await http.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0},
                )
                summary = response.json()["speculation"]
                for key in totals:
                    totals[key] += summary[key]
                per_position = [
                    a + b
                    for a, b in zip(per_position, summary["accepted_per_position"], strict=True)
                ]
        # The whole run sits inside the rules' one-minute window, so the ratio
        # of rates is the ratio of what the responses reported. Other test
        # servers in this process export other models: select ours.
        tiny = '{model="tiny"}'
        await _wait_for(
            prom,
            f"specserve:spec_decode_acceptance_rate:rate1m{tiny}",
            {"": totals["accepted_tokens"] / totals["draft_tokens"]},
        )
        await _wait_for(
            prom,
            f"specserve:spec_decode_mean_acceptance_length:rate1m{tiny}",
            {"": 1 + totals["accepted_tokens"] / totals["drafts"]},
        )
        await _wait_for(
            prom,
            f"specserve:spec_decode_position_acceptance_rate:rate1m{tiny}",
            {str(p): n / totals["drafts"] for p, n in enumerate(per_position)},
        )
        ttft = await _query(prom, f"specserve:time_to_first_token_seconds:p95{tiny}")
        assert ttft[""] > 0
        tokens = await _query(prom, f"specserve:generation_tokens:rate1m{tiny}")
        assert tokens[""] > 0
