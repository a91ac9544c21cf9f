"""Metric definitions against hand-made request timelines."""

import math

import pytest

from loadtest.metrics import is_good, parse_slos, percentile, summarize
from loadtest.records import RequestRecord


def done(index: int, ttft: float, itl: list[float], tokens: int, prompt: int = 10) -> RequestRecord:
    return RequestRecord(
        index=index,
        item=f"item-{index}",
        server="s",
        success=True,
        status=200,
        ttft=ttft,
        itl=itl,
        e2el=ttft + sum(itl),
        prompt_tokens=prompt,
        output_tokens=tokens,
    )


def failed(index: int, status: int | None) -> RequestRecord:
    return RequestRecord(index=index, item="x", server="s", status=status, error="no")


# Request 0: first text at 0.5 s, then 3 chunks 0.1 s apart, 7 tokens (chunks of
# several tokens, as speculation produces): E2EL 0.8, TPOT (0.8-0.5)/6 = 0.05.
# Request 1: first text at 1.0 s, one more chunk after 0.4 s, 2 tokens: TPOT 0.4.
# Request 2: a single token at 0.2 s: no ITL, no TPOT.
TIMELINE = [
    done(0, 0.5, [0.1, 0.1, 0.1], 7),
    done(1, 1.0, [0.4], 2),
    done(2, 0.2, [], 1),
]


def test_per_request_tpot() -> None:
    assert TIMELINE[0].tpot == pytest.approx(0.05)
    assert TIMELINE[1].tpot == pytest.approx(0.4)
    assert TIMELINE[2].tpot is None


def test_summary_of_a_hand_made_run() -> None:
    records = [*TIMELINE, failed(3, 429), failed(4, 503), failed(5, None), failed(6, 200)]
    summary = summarize(records, duration=4.0)
    assert summary["requests"] == 7
    assert summary["completed"] == 3
    assert summary["failed"] == 4
    assert summary["failures_by_status"] == {
        "429": 1,
        "503": 1,
        "no response": 1,
        "error after 200": 1,
    }
    assert summary["total_output_tokens"] == 10
    assert summary["total_prompt_tokens"] == 30
    assert summary["request_throughput"] == pytest.approx(3 / 4)
    assert summary["output_throughput"] == pytest.approx(10 / 4)
    assert summary["total_token_throughput"] == pytest.approx(40 / 4)
    # TTFT samples 0.2, 0.5, 1.0 (ms): mean 566.67; p90 interpolates 0.5 -> 1.0 at 0.8.
    assert summary["ttft_ms"]["mean"] == pytest.approx(1700 / 3)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500)
    assert summary["ttft_ms"]["p90"] == pytest.approx(900)
    assert summary["ttft_ms"]["p99"] == pytest.approx(990)
    # TPOT only from requests with >= 2 tokens: 50 and 400 ms.
    assert summary["tpot_ms"]["mean"] == pytest.approx(225)
    assert summary["tpot_ms"]["p50"] == pytest.approx(225)
    # ITL pools every gap of every request: 100, 100, 100, 400 ms.
    assert summary["itl_ms"]["mean"] == pytest.approx(175)
    assert summary["itl_ms"]["p50"] == pytest.approx(100)
    assert summary["itl_ms"]["p99"] == pytest.approx(100 + 300 * 0.97)
    # E2EL: 0.8, 1.4, 0.2 s.
    assert summary["e2el_ms"]["mean"] == pytest.approx(800)
    assert summary["e2el_ms"]["p50"] == pytest.approx(800)
    assert "request_goodput" not in summary


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_slos(["ttft:600", "tpot:100"])
    # Request 0 meets both; 1 misses TPOT (400 ms); 2 has one token, so TPOT 0 (as vLLM).
    assert [is_good(r, slos) for r in TIMELINE] == [True, False, True]
    summary = summarize([*TIMELINE, failed(3, 503)], duration=2.0, slos=slos)
    assert summary["good_requests"] == 2
    assert summary["request_goodput"] == pytest.approx(1.0)
    assert summarize(TIMELINE, 2.0, parse_slos(["e2el:1000"]))["good_requests"] == 2


def test_no_completed_requests_gives_nan_not_an_error() -> None:
    summary = summarize([failed(0, 429)], duration=1.0)
    assert summary["completed"] == 0
    assert math.isnan(summary["ttft_ms"]["mean"]) and math.isnan(summary["tpot_ms"]["p99"])
    assert summary["output_throughput"] == 0


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [([3.0], 99, 3.0), ([1.0, 2.0], 50, 1.5), ([4.0, 1.0, 3.0, 2.0], 90, 3.7), ([], 50, math.nan)],
)
def test_percentile_interpolates_like_numpy(values: list[float], p: float, expected: float) -> None:
    result = percentile(values, p)
    assert (math.isnan(result) and math.isnan(expected)) or result == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:-1", "tpot:abc"])
def test_bad_slos_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_slos([bad])
