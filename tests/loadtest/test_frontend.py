"""The front-end benchmark end to end: specserve over the synthetic engine in a child process,
every cell served in full. Its numbers are printed as a report, never asserted: they belong to
the machine (see loadtest/frontend.py)."""

import asyncio
from pathlib import Path

import pytest

from loadtest import cli
from loadtest.frontend import SyntheticEngine, top_functions
from server.engine.contract import GenerationRequest, SamplingOptions


def test_the_synthetic_engine_streams_a_token_per_output_or_sends_the_reply_whole() -> None:
    async def outputs(stream: bool) -> list[list[int]]:
        request = GenerationRequest("r", [1, 1], SamplingOptions(max_tokens=5, n=2), stream)
        return [
            [len(choice.token_ids) for choice in output.choices]
            async for output in SyntheticEngine().generate(request)
        ]

    assert asyncio.run(outputs(stream=True)) == [[1, 1]] * 5
    assert asyncio.run(outputs(stream=False)) == [[5, 5]]


def test_the_frontend_report_has_every_cell_with_every_token_and_no_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests, tokens = 64, 32
    cli.main(
        [
            "frontend",
            "--concurrency", "1", "8", "64",
            "--num-requests", str(requests),
            "--max-tokens", str(tokens),
            "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    report = (tmp_path / "summary.md").read_text()
    rows = [line.split(" | ") for line in report.splitlines() if line[:3] in ("| 1", "| 6", "| 8")]
    assert [(row[0], row[1]) for row in rows] == [
        (f"| {c}", mode) for c in (1, 8, 64) for mode in ("streamed", "whole")
    ]
    for row in rows:
        assert int(row[2]) == requests * tokens  # tokens served
        assert row[-1] == "0 |"  # failed
        assert float(row[4]) > 0  # the server's CPU per token was measured
    with capsys.disabled():
        print("\n" + report)


def test_top_functions_rank_own_time_add_a_functions_lines_and_count_recursion_once() -> None:
    raw = "\n".join(
        [
            "main (app/server.py:10);send (h11/conn.py:20) 3",
            "main (app/server.py:12);send (h11/conn.py:25) 1",
            "main (app/server.py:10);walk (app/tree.py:5);walk (app/tree.py:7) 4",
        ]
    )
    assert top_functions(raw) == [
        ("send (conn.py)", 0.5, 0.5),
        ("walk (tree.py)", 0.5, 0.5),
        ("main (server.py)", 1.0, 0.0),
    ]
