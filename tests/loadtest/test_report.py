"""Markdown, JSON and PNG output from hand-made results."""

import json
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.metrics import summarize
from loadtest.records import RequestRecord


def result(ttft: float, speculation: dict[str, Any] | None) -> dict[str, Any]:
    records = [
        RequestRecord(i, f"i{i}", "s", success=True, status=200, ttft=ttft, itl=[0.1, 0.1],
                      e2el=ttft + 0.2, output_tokens=5)
        for i in range(3)
    ]  # fmt: skip
    records.append(RequestRecord(3, "i3", "s", status=429, error="busy"))
    return {
        "summary": summarize(records, duration=2.0),
        "speculation": speculation,
        "records": [r.to_json() for r in records],
    }


SPEC = {
    "acceptance_rate": 0.75,
    "mean_acceptance_length": 2.5,
    "acceptance_by_position": [0.9, 0.6],
}


def test_side_by_side_with_ratios_and_failures(tmp_path: Path) -> None:
    servers = {"spec": result(0.2, SPEC), "plain": result(0.4, None)}
    markdown = report.run_markdown("t", {"workload": "prose", "rounds": None}, servers)
    assert "| metric | spec | plain | spec / plain |" in markdown
    assert "| TTFT mean (ms) | 200.00 | 400.00 | 0.50 |" in markdown
    assert "| completed | 3 | 3 | 1.00 |" in markdown
    assert "| acceptance rate | 0.75 | - |  |" in markdown
    assert "| acceptance by position | 0.90 0.60 | - |  |" in markdown
    assert "- spec: failures 429: 1" in markdown
    assert "rounds" not in markdown  # unset settings are left out
    report.plot_latency_cdfs(tmp_path / "cdf.png", servers)
    assert (tmp_path / "cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert report.plot_acceptance(tmp_path / "acc.png", {"spec": [0.9, 0.6], "plain": None})
    assert not report.plot_acceptance(tmp_path / "none.png", {"plain": None})
    assert not (tmp_path / "none.png").exists()


def test_sweep_markdown_and_plot(tmp_path: Path) -> None:
    levels = [
        {
            "level": c,
            "speedup": s,
            "servers": {"spec": result(0.2, SPEC), "plain": result(0.3, None)},
        }
        for c, s in ((1, 1.2), (2, 0.8))
    ]
    suggestion = {
        "kind": "concurrency",
        "stops_paying_at": 2,
        "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 16, 0]],
    }
    markdown = report.sweep_markdown({"workload": "prose"}, levels, suggestion)
    assert "Speculation stops paying at concurrency 2." in markdown
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 16, 0]]' in markdown
    assert "| 1 | 7.50 | 7.50 |" in markdown
    report.plot_sweep(tmp_path / "sweep.png", "concurrency", levels)
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_json_writes_nan_as_null(tmp_path: Path) -> None:
    report.write_json(tmp_path / "r.json", {"a": float("nan"), "b": [1.0, float("nan")]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": None, "b": [1.0, None]}
