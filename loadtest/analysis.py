"""Side-by-side ratios, round by round, and the speculation schedule a sweep suggests.

Alternating rounds put each of A's blocks of requests next to one of B's, so
`paired_speedup` compares them pair by pair: a slow machine hour slows both
blocks of a pair alike and drops out of their ratio. Its 95% interval says how
small a difference the run can tell from noise.

A sweep decides per load level whether speculation paid: the speculative
server's output token throughput over the baseline's, above 1 + margin. Under
a fixed concurrency c the engine runs batches of about c, so the decisions
become vLLM's `num_speculative_tokens_per_batch_size`: [[min_batch,
max_batch, K], ...] with K=0 meaning no speculation. A batch size between two
measured levels takes the decision of the next level up (an unmeasured size
is treated like the larger neighbour), the largest measured level's decision
holds up to `max_batch`, and neighbouring ranges with the same K merge.
"""

import math
import statistics
from collections.abc import Sequence
from typing import Any

# (label, path in the summary) of each figure compared; latencies in ms.
ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("request throughput (req/s)", ("request_throughput",)),
    ("output throughput (tok/s)", ("output_throughput",)),
    ("cached prompt share", ("cached_prompt_share",)),
    ("goodput (req/s)", ("request_goodput",)),
    *[
        (f"{name.upper()} {stat} (ms)", (f"{name}_ms", stat))
        for name in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "p50", "p90", "p99")
    ],
]
SPEC_ROWS = [
    ("acceptance rate", "acceptance_rate"),
    ("mean acceptance length", "mean_acceptance_length"),
]


def lookup(data: dict[str, Any], path: Sequence[str]) -> float | None:
    value: Any = data
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value  # ints stay ints: counts print without decimals


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """A / B for every compared figure of two summaries."""
    return {label: ratio(lookup(a, path), lookup(b, path)) for label, path in ROWS}


def speedup(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """How much faster A produced output than B (output tokens/s ratio)."""
    return ratio(lookup(a, ("output_throughput",)), lookup(b, ("output_throughput",)))


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
T_95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def paired_speedup(
    a_blocks: Sequence[dict[str, float]], b_blocks: Sequence[dict[str, float]]
) -> dict[str, float | int | None] | None:
    """A's output tokens/s over B's from the blocks of the same rounds: the geometric
    mean of the per-round ratios and its 95% interval (t on their logs; None with one
    round). None without a round where both produced output."""
    logs = [
        math.log((a["output_tokens"] / a["duration_s"]) / (b["output_tokens"] / b["duration_s"]))
        for a, b in zip(a_blocks, b_blocks, strict=False)
        if min(a["output_tokens"], a["duration_s"], b["output_tokens"], b["duration_s"]) > 0
    ]
    if not logs:
        return None
    mean = statistics.fmean(logs)
    low = high = None
    if len(logs) > 1:
        t = T_95[len(logs) - 2] if len(logs) - 1 <= len(T_95) else 1.96
        half = t * statistics.stdev(logs) / math.sqrt(len(logs))
        low, high = math.exp(mean - half), math.exp(mean + half)
    return {"rounds": len(logs), "speedup": math.exp(mean), "low": low, "high": high}


def schedule(
    levels: Sequence[int], speedups: Sequence[float | None], k: int, margin: float, max_batch: int
) -> list[list[int]]:
    """[[min_batch, max_batch, K], ...] from measured speedups per concurrency level."""
    if k < 1:
        raise ValueError("K must be at least 1 to suggest where to speculate")
    pairs = sorted(zip(levels, speedups, strict=True))
    table: list[list[int]] = []
    low = 1
    for index, (level, gain) in enumerate(pairs):
        high = max_batch if index == len(pairs) - 1 else level
        if high < low:
            continue
        # An unmeasured (failed) level counts as not paying: off when unsure.
        use = k if gain is not None and gain > 1 + margin else 0
        if table and table[-1][2] == use:
            table[-1][1] = high
        else:
            table.append([low, high, use])
        low = high + 1
    return table


def stops_paying(
    levels: Sequence[float], speedups: Sequence[float | None], margin: float
) -> float | None:
    """The lowest level at which speculation no longer paid (None: it paid at all)."""
    for level, gain in sorted(zip(levels, speedups, strict=True)):
        if gain is None or gain <= 1 + margin:
            return level
    return None
