"""Benchmark metrics from request records, defined as vLLM's serving benchmark does.

- TTFT: request sent -> first chunk that carries generated text.
- ITL: every gap between consecutive text chunks of a request (a chunk can
  hold several tokens, which is what speculation does to a stream).
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with > 1 token.
- E2EL: request sent -> last text chunk.
- Throughputs divide by the wall time of the run (first send -> last finish):
  completed requests/s, output tokens/s, prompt + output tokens/s.
- Goodput: completed requests/s meeting every SLO given (ttft, tpot, e2el in
  ms); as in vLLM a request with < 2 tokens has TPOT 0 for this test.
- Failures (HTTP errors such as 429/503, stream errors, timeouts) are counted
  and excluded from latency and throughput.
Percentiles interpolate linearly between samples, as numpy's default does.
"""

import math
from collections.abc import Sequence
from typing import Any

from loadtest.records import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and percentiles in milliseconds (NaN when there are no samples)."""
    stats = {"mean": sum(values) / len(values) * 1000 if values else math.nan}
    for p in PERCENTILES:
        stats[f"p{p}"] = percentile(values, p) * 1000
    return stats


def parse_slos(pairs: Sequence[str]) -> dict[str, float]:
    """`ttft:500 tpot:100` -> {"ttft": 500.0, "tpot": 100.0} (milliseconds)."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"SLO {pair!r}: expected NAME:MS with NAME one of {SLO_NAMES}")
        slos[name] = float(value)
        if slos[name] <= 0:
            raise ValueError(f"SLO {pair!r}: the limit must be positive")
    return slos


def is_good(record: RequestRecord, slos: dict[str, float]) -> bool:
    if not record.success:
        return False
    measured = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all((measured[name] or 0.0) * 1000 <= limit for name, limit in slos.items())


def summarize(
    records: Sequence[RequestRecord], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Every figure of one server's run; latencies in ms, rates per second."""
    done = [r for r in records if r.success]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures_by_status": _failures_by_status(records),
        "duration_s": duration,
        "total_prompt_tokens": prompt,
        "total_cached_prompt_tokens": cached,
        "cached_prompt_share": cached / prompt if prompt else math.nan,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration > 0 else math.nan,
        "output_throughput": output / duration if duration > 0 else math.nan,
        "total_token_throughput": (prompt + output) / duration if duration > 0 else math.nan,
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "e2el_ms": distribution_ms([r.e2el for r in done if r.e2el is not None]),
        "output_tokens_from_chunks": sum(r.output_tokens_source == "chunks" for r in done),
    }
    if slos:
        good = sum(is_good(r, slos) for r in records)
        summary["slos_ms"] = dict(slos)
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration if duration > 0 else math.nan
    return summary


def _failures_by_status(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        if not record.success:
            if record.status is None:
                key = "no response"
            elif record.status == 200:
                key = "error after 200"
            else:
                key = str(record.status)
            counts[key] = counts.get(key, 0) + 1
    return counts
