"""deploy/prometheus against the real tools: promtool checks and unit tests, and
a real Prometheus scraping specserve whose recording rules must reproduce the
speculation figures the responses reported.

`make test` installs Debian's prometheus package (server and promtool).
"""

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.conftest import RunningServer, TinyModels, serve, tiny_engine_config
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


@pytest.fixture(scope="module")
async def fresh_server(tiny: TinyModels) -> AsyncIterator[RunningServer]:
    """A server of its own (a model name no other test uses), so the first
    request Prometheus sees is the first this model's series ever counted."""
    config = tiny_engine_config(tiny, tiny.close_draft, served_model_name="tiny-prom")
    async for running in serve(config):
        yield running


@pytest.fixture
async def prometheus(fresh_server: RunningServer, tmp_path: Path) -> AsyncIterator[str]:
    """A Prometheus on loopback scraping `fresh_server` every second with our rules."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DEPLOY / "rules.yml")]
    config["scrape_configs"][0]["static_configs"] = [
        {"targets": [fresh_server.base_url.removeprefix("http://")]}
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


async def _wait_until(
    http: httpx.AsyncClient, expr: str, holds: Callable[[dict[str, float]], bool], wanted: str
) -> None:
    last: dict[str, float] = {}
    for _ in range(60):
        last = await _query(http, expr)
        if holds(last):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{expr}: got {last}, expected {wanted}")


async def _wait_for(http: httpx.AsyncClient, expr: str, expected: dict[str, float]) -> None:
    await _wait_until(
        http,
        expr,
        lambda last: (
            last.keys() == expected.keys()
            and all(last[k] == pytest.approx(v, rel=1e-9) for k, v in expected.items())
        ),
        str(expected),
    )


def _positive(last: dict[str, float]) -> bool:
    return last.keys() == {""} and last[""] > 0


async def test_recording_rules_reproduce_the_responses(
    fresh_server: RunningServer, prometheus: str
) -> None:
    model = '{model="tiny-prom"}'
    async with httpx.AsyncClient(base_url=prometheus, timeout=30) as prom:
        # Before any request, a scrape already holds every series at zero: the
        # server creates them at startup, so `rate()` sees the first requests
        # however fast the machine serves them.
        for series in (
            "specserve_time_to_first_token_seconds_count",
            "specserve_e2e_request_latency_seconds_count",
            "specserve_generation_tokens_total",
            "specserve_spec_decode_draft_tokens_total",
        ):
            await _wait_for(prom, f"sum({series}{model})", {"": 0.0})
        totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        per_position = [0, 0, 0]
        async with httpx.AsyncClient(base_url=fresh_server.base_url, timeout=120) as http:
            for prompt in ("def add(a, b):", "The weather today", "import os\n"):
                body = {"model": "tiny-prom", "prompt": prompt, "max_tokens": 40, "temperature": 0}
                response = await http.post("/v1/completions", json=body)
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
        await _wait_for(
            prom,
            f"specserve:spec_decode_acceptance_rate:rate1m{model}",
            {"": totals["accepted_tokens"] / totals["draft_tokens"]},
        )
        await _wait_for(
            prom,
            f"specserve:spec_decode_mean_acceptance_length:rate1m{model}",
            {"": 1 + totals["accepted_tokens"] / totals["drafts"]},
        )
        await _wait_for(
            prom,
            f"specserve:spec_decode_position_acceptance_rate:rate1m{model}",
            {str(p): n / totals["drafts"] for p, n in enumerate(per_position)},
        )
        for rule in ("time_to_first_token_seconds:p95", "generation_tokens:rate1m"):
            await _wait_until(prom, f"specserve:{rule}{model}", _positive, "one value above 0")
