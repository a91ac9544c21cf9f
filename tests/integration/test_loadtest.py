"""loadtest against specserve on the real engine and tiny models.

The self-drafting server accepts every draft token, so the acceptance figures
loadtest derives from /metrics deltas are known exactly; they must also agree
with the per-request speculation summaries the same requests carried.
"""

import itertools
import json
from pathlib import Path

import pytest

from loadtest import cli
from tests.integration.conftest import RunningServer

pytestmark = pytest.mark.integration


async def test_compare_self_draft_against_plain(
    self_draft_server: RunningServer, plain_server: RunningServer, tmp_path: Path
) -> None:
    out = await cli.execute(
        [
            "compare",
            "--a", self_draft_server.base_url, "--a-label", "spec",
            "--b", plain_server.base_url, "--b-label", "plain",
            "--workload", "code-completion",
            "--num-requests", "5", "--concurrency", "2", "--rounds", "2",
            "--max-tokens", "12", "--warmup", "1", "--goodput", "e2el:60000",
            "--no-progress", "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    data = json.loads((out / "results.json").read_text())
    spec, plain = data["servers"]["spec"], data["servers"]["plain"]
    for result in (spec, plain):
        summary = result["summary"]
        assert summary["completed"] == 5 and summary["failed"] == 0
        assert summary["good_requests"] == 5
        for record in result["records"]:
            assert record["success"] and record["output_tokens_source"] == "usage"
            assert 0 < record["output_tokens"] <= 12
            assert 0 < record["ttft"] <= record["e2el"]
            assert record["e2el"] == pytest.approx(record["ttft"] + sum(record["itl"]))
        assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in result["records"])
    # Both got the same prompts in the same order, and greedy speculation is lossless.
    assert [r["item"] for r in spec["records"]] == [r["item"] for r in plain["records"]]
    assert [r["text"] for r in spec["records"]] == [r["text"] for r in plain["records"]]

    speculation = spec["speculation"]
    assert speculation["source"] == "specserve"
    assert speculation["draft_tokens"] > 0
    assert speculation["acceptance_rate"] == 1.0
    assert speculation["acceptance_by_position"] == [1.0, 1.0, 1.0]
    # Counter deltas over the run equal the sum of the per-request summaries:
    # the other server's turns and the warm-up stay out.
    per_request = [r["speculation"] for r in spec["records"]]
    assert speculation["accepted_tokens"] == sum(s["accepted_tokens"] for s in per_request)
    assert speculation["drafts"] == sum(s["drafts"] for s in per_request)
    assert plain["speculation"]["drafts"] == 0
    assert plain["speculation"]["acceptance_rate"] is None

    assert data["speedup"] == pytest.approx(
        spec["summary"]["output_throughput"] / plain["summary"]["output_throughput"]
    )
    summary_md = (out / "summary.md").read_text()
    assert "| output throughput (tok/s) |" in summary_md
    assert (out / "latency_cdf.png").stat().st_size > 0
    assert (out / "acceptance_by_position.png").stat().st_size > 0


async def test_refused_requests_are_counted_not_fatal(
    plain_server: RunningServer, tmp_path: Path
) -> None:
    out = await cli.execute(
        [
            "run", "--url", plain_server.base_url, "--model", "no-such-model",
            "--workload", "prose", "--num-requests", "3", "--warmup", "0",
            "--no-progress", "--no-plots", "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    summary = json.loads((out / "results.json").read_text())["servers"]["server"]["summary"]
    assert summary["completed"] == 0
    assert summary["failed"] == 3
    assert summary["failures_by_status"] == {"404": 3}


async def test_sweep_suggests_a_schedule(
    self_draft_server: RunningServer, plain_server: RunningServer, tmp_path: Path
) -> None:
    out = await cli.execute(
        [
            "sweep", "--a", self_draft_server.base_url, "--b", plain_server.base_url,
            "--workload", "structured", "--concurrency", "1", "2",
            "--num-requests", "2", "--max-tokens", "8", "--max-batch", "64",
            "--no-progress", "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    data = json.loads((out / "results.json").read_text())
    levels = data["levels"]
    assert [level["level"] for level in levels] == [1, 2]
    table = data["suggestion"]["num_speculative_tokens_per_batch_size"]
    # Whatever the timing says, the table covers 1..64 without gaps, with K=3 or 0.
    assert table[0][0] == 1 and table[-1][1] == 64
    assert all(row[2] in (0, 3) for row in table)
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(table))
    for level, row_k in zip(levels, [table[0][2], table[-1][2]], strict=True):
        assert (row_k == 3) == (level["speedup"] > 1)
    assert (out / "sweep.png").stat().st_size > 0
