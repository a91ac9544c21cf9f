"""Where an engine's time went, from the autopilot's step trace (`--speculation-trace FILE`):
time and tokens by kind of step, and what the step after a rejected proposal made against the
step after a fully accepted one (how fast a request resynchronises after the text changes).

    python scripts/speculation_trace.py TRACE [--skip N]

Kinds of step, by what the step verified and ran: `prefill` (it prefilled prompt tokens),
`off` (the draft idled because every request in it asked for no drafts,
`speculation.max_draft_tokens: 0`, where the autopilot would have drafted: part of the K=0 side
of a benchmark run on one server; the rest of it, where the autopilot idled the draft anyway,
is `plain`), `lookup` (it verified looked-up tokens), `draft` (it verified
the draft's proposals or the draft proposed at its end), `plain` (neither). `+catch-up` marks
steps where the draft caught up on tokens it had not seen. A step "after" another is the next
step of the trace, so the figures after a rejection are meaningful with one request at a time.
"""

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any


@dataclass
class Tally:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    verified: int = 0

    def add(self, step: dict[str, Any]) -> None:
        self.steps += 1
        self.seconds += step["seconds"]
        self.tokens += step["generated"]
        self.verified += step["verified"]

    def row(self, name: str, total_seconds: float) -> str:
        return (
            f"| {name} | {self.steps} | {self.seconds:.2f} | {self.seconds / total_seconds:.0%} "
            f"| {1000 * self.seconds / self.steps:.1f} | {self.tokens / self.steps:.2f} "
            f"| {self.tokens / self.seconds:.1f} | {self.verified} |"
        )


def kind(step: dict[str, Any]) -> str:
    if step["prefill_tokens"]:
        name = "prefill"
    elif step["reason"] == "requested_off":
        name = "off"
    elif step["lookups"]:
        name = "lookup"
    elif step["verified"] or step["k"]:
        name = "draft"
    else:
        name = "plain"
    return name + ("+catch-up" if step["caught_up"] else "")


def summary(steps: list[dict[str, Any]]) -> str:
    by_kind: dict[str, Tally] = defaultdict(Tally)
    for step in steps:
        by_kind[kind(step)].add(step)
    total = sum(t.seconds for t in by_kind.values())
    lines = [
        "| kind | steps | s | share | ms / step | tokens / step | tokens / s | verified |",
        "|---|---|---|---|---|---|---|---|",
        *(by_kind[name].row(name, total) for name in sorted(by_kind)),
    ]
    after = {"after a rejected proposal": Tally(), "after a fully accepted one": Tally()}
    speculating = [s for s in steps if kind(s) != "off"]
    for previous, step in pairwise(speculating):
        if not previous["verified"] or previous["prefill_tokens"] or step["prefill_tokens"]:
            continue
        rejected = previous["generated"] - 1 < previous["verified"]
        after["after a rejected proposal" if rejected else "after a fully accepted one"].add(step)
    lines += [
        "",
        "| next step | steps | s | share | ms / step | tokens / step | tokens / s | verified |",
        "|---|---|---|---|---|---|---|---|",
        *(tally.row(name, total) for name, tally in after.items() if tally.steps),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--skip", type=int, default=0, help="leading steps to leave out")
    args = parser.parse_args()
    with args.trace.open() as lines:
        steps = [json.loads(line) for line in lines][args.skip :]
    print(summary(steps))


if __name__ == "__main__":
    main()
