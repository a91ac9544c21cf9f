"""Speculation figures from Prometheus text: specserve's and vLLM's names."""

import math

import pytest

from loadtest.promscrape import parse, speculative_tokens

SPECSERVE = """\
# HELP specserve_spec_decode_drafts_total Verify steps that checked a draft
# TYPE specserve_spec_decode_drafts_total counter
specserve_spec_decode_drafts_total{model="m",tenant="anonymous"} 10.0
specserve_spec_decode_drafts_total{model="m",tenant="team-b"} 10.0
specserve_spec_decode_draft_tokens_total{model="m",tenant="anonymous"} 40.0
specserve_spec_decode_accepted_tokens_total{model="m",tenant="anonymous"} 30.0
specserve_spec_decode_accepted_tokens_per_position_total{model="m",position="0",tenant="a"} 18.0
specserve_spec_decode_accepted_tokens_per_position_total{model="m",position="1",tenant="a"} 12.0
specserve_spec_decode_drafts_created 1.7e9
specserve_speculative_tokens{model="m"} 2.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 999.0
"""

VLLM = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 8.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 24.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
"""


def test_specserve_counters_win_and_sum_over_labels() -> None:
    counters = parse(SPECSERVE)
    assert counters is not None
    assert counters.source == "specserve"
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (20, 40, 30)
    assert counters.per_position == {0: 18, 1: 12}
    assert speculative_tokens(SPECSERVE) == 2


def test_vllm_server_counters() -> None:
    counters = parse(VLLM)
    assert counters is not None and counters.source == "vllm"
    figures = counters.figures()
    assert figures["acceptance_rate"] == pytest.approx(0.5)
    assert figures["mean_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert figures["acceptance_by_position"] == pytest.approx([0.75, 0.5, 0.25])
    assert speculative_tokens(VLLM) is None


def test_deltas_over_a_run() -> None:
    before = parse(VLLM)
    after = parse(
        VLLM.replace("} 8.0", "} 18.0").replace("} 24.0", "} 54.0").replace("} 12.0", "} 33.0")
    )
    assert before is not None and after is not None
    delta = after - before
    assert (delta.drafts, delta.draft_tokens, delta.accepted) == (10, 30, 21)
    assert delta.figures()["acceptance_rate"] == pytest.approx(0.7)
    total = delta + delta
    assert total.drafts == 20 and total.per_position == {0: 0, 1: 0, 2: 0}


def test_no_speculation_counters() -> None:
    assert parse('specserve_requests_total{endpoint="chat",status="200"} 3.0\n') is None


def test_nothing_drafted_gives_nan_rates() -> None:
    counters = parse('specserve_spec_decode_drafts_total{model="m",tenant="anonymous"} 0.0\n')
    assert counters is not None
    figures = counters.figures()
    assert math.isnan(figures["acceptance_rate"]) and math.isnan(figures["mean_acceptance_length"])
