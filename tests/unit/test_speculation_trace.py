"""scripts/speculation_trace.py on a small trace: each step counted under its kind, and the step
after a rejected proposal told apart from the step after a fully accepted one."""

import json
import subprocess
import sys
from pathlib import Path


def _step(seconds: float, generated: int, **fields: object) -> dict[str, object]:
    step: dict[str, object] = {
        "seconds": seconds, "batch": 1, "verified": 0, "prefill_tokens": 0, "caught_up": 0,
        "generated": generated, "k": 0, "reason": None, "lookups": 0,
    }  # fmt: skip
    step.update(fields)
    return step


STEPS = [
    _step(0.2, 1, prefill_tokens=30, caught_up=30, k=3),  # prefill, the draft with it
    _step(0.1, 4, verified=3, k=3),  # draft: all 3 accepted
    _step(0.1, 2, verified=3, k=3),  # draft: the second rejected
    _step(0.05, 3, verified=4, lookups=1),  # lookup, after the rejection
    _step(0.09, 1, caught_up=6, k=3),  # the draft catches up
    _step(0.04, 1, reason="requested_off"),  # a request that asked for no drafts
    _step(0.04, 1, reason="not_paying"),  # plain: the autopilot idled the draft
]


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 8 and cells[1].isdigit():
            rows[cells[0]] = cells[1:]
    return rows


def test_steps_are_tallied_by_kind_and_by_what_came_before(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(step) + "\n" for step in STEPS))
    script = Path(__file__).parents[2] / "scripts" / "speculation_trace.py"
    result = subprocess.run(
        [sys.executable, str(script), str(trace)], capture_output=True, text=True, check=True
    )
    rows = _rows(result.stdout)
    # steps, seconds, share, ms per step, tokens per step, tokens per second, verified
    assert rows["prefill+catch-up"] == ["1", "0.20", "32%", "200.0", "1.00", "5.0", "0"]
    assert rows["draft"] == ["2", "0.20", "32%", "100.0", "3.00", "30.0", "6"]
    assert rows["lookup"][:2] == ["1", "0.05"] and rows["lookup"][-1] == "4"
    assert rows["draft+catch-up"][:2] == ["1", "0.09"]
    assert rows["off"][:2] == rows["plain"][:2] == ["1", "0.04"]
    # After the fully accepted step: the step that rejected; after a rejection: the lookup,
    # then the catch-up (the lookup rejected one of its four).
    assert rows["after a fully accepted one"][:2] == ["1", "0.10"]
    assert rows["after a rejected proposal"][:2] == ["2", "0.14"]
    skipped = subprocess.run(
        [sys.executable, str(script), str(trace), "--skip", "6"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert list(_rows(skipped.stdout)) == ["plain"]
