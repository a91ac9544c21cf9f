"""Ratios and the suggested per-batch-size speculation schedule."""

import pytest

from loadtest.analysis import paired_speedup, ratios, schedule, speedup, stops_paying


def test_pays_only_at_batch_one() -> None:
    assert schedule([1, 2, 4], [1.3, 0.9, 0.7], k=2, margin=0.0, max_batch=16) == [
        [1, 1, 2],
        [2, 16, 0],
    ]


def test_between_levels_takes_the_level_above() -> None:
    # Pays at 1 and 4, not at 8: batches 5..8 are off, 2..4 on.
    assert schedule([8, 1, 4], [0.95, 1.5, 1.1], k=3, margin=0.0, max_batch=64) == [
        [1, 4, 3],
        [5, 64, 0],
    ]


def test_pays_everywhere_and_nowhere() -> None:
    assert schedule([1, 2], [1.2, 1.1], k=2, margin=0.0, max_batch=8) == [[1, 8, 2]]
    assert schedule([1, 2], [0.8, 0.9], k=2, margin=0.0, max_batch=8) == [[1, 8, 0]]


def test_margin_and_unmeasured_levels_switch_off() -> None:
    assert schedule([1, 2], [1.04, None], k=2, margin=0.05, max_batch=8) == [[1, 8, 0]]
    assert schedule([1, 2, 3], [1.2, None, 1.2], k=2, margin=0.0, max_batch=8) == [
        [1, 1, 2],
        [2, 2, 0],
        [3, 8, 2],
    ]


def test_k_must_be_positive() -> None:
    with pytest.raises(ValueError):
        schedule([1], [2.0], k=0, margin=0.0, max_batch=8)


def test_stops_paying() -> None:
    assert stops_paying([1, 2, 4], [1.2, 1.01, 0.9], margin=0.02) == 2
    assert stops_paying([1, 2], [1.2, 1.1], margin=0.0) is None


def test_ratios_and_speedup() -> None:
    a = {"output_throughput": 6.0, "ttft_ms": {"mean": 100.0}, "completed": 4, "failed": 0}
    b = {"output_throughput": 4.0, "ttft_ms": {"mean": 200.0}, "completed": 4, "failed": 0}
    result = ratios(a, b)
    assert result["output throughput (tok/s)"] == pytest.approx(1.5)
    assert result["TTFT mean (ms)"] == pytest.approx(0.5)
    assert result["failed"] is None  # 0 / 0
    assert result["TPOT p99 (ms)"] is None  # missing
    assert speedup(a, b) == pytest.approx(1.5)


def block(tokens: float, seconds: float) -> dict[str, float]:
    return {"output_tokens": tokens, "duration_s": seconds}


def test_round_by_round_drift_cancels_and_the_interval_shows_the_noise() -> None:
    # The machine slows down 2x over the run; A is 10% faster in every round.
    a = [block(110, 1.0), block(110, 2.0), block(110, 1.5)]
    b = [block(100, 1.0), block(100, 2.0), block(100, 1.5)]
    steady = paired_speedup(a, b)
    assert steady is not None
    assert steady["speedup"] == pytest.approx(1.1)
    assert steady["low"] == pytest.approx(1.1) and steady["high"] == pytest.approx(1.1)
    # Pooled, the same blocks give the same 1.1; rounds that disagree widen the interval.
    noisy = paired_speedup([block(120, 1.0), block(100, 1.0), block(110, 1.0)], b[:1] * 3)
    assert noisy is not None and noisy["rounds"] == 3
    assert noisy["low"] < 1.0 < 1.1 < noisy["high"]


def test_round_by_round_needs_output_on_both_sides() -> None:
    assert paired_speedup([block(0, 1.0)], [block(10, 1.0)]) is None
    one = paired_speedup([block(20, 1.0)], [block(10, 1.0)])
    assert one == {"rounds": 1, "speedup": pytest.approx(2.0), "low": None, "high": None}
