"""How vLLM's per-sequence outputs map onto the engine contract (no engine needed)."""

from types import SimpleNamespace

import pytest

from server.engine.contract import SamplingOptions
from server.engine.vllm_outputs import (
    FinishedLookups,
    finish_reason,
    scheduler_args,
    speculation_stats,
)
from server.errors import EngineUnavailableError, InternalError
from server.vllm_plugins.request_args import (
    LOOKUP_COUNTS_PARAM,
    MAX_DRAFT_TOKENS_ARG,
    NO_LOOKUPS_ARG,
    REQUEST_ARG,
    TENANT_ARG,
)


@pytest.mark.parametrize(
    ("reason", "mapped"),
    [("stop", "stop"), ("length", "length"), ("repetition", "stop"), (None, None)],
)
def test_finish_reasons_use_openai_vocabulary(reason: str | None, mapped: str | None) -> None:
    assert finish_reason(reason) == mapped


@pytest.mark.parametrize(
    ("reason", "error"), [("error", InternalError), ("abort", EngineUnavailableError)]
)
def test_engine_failures_become_errors(reason: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        finish_reason(reason)


def test_speculation_histogram_folds_into_per_position_counts_and_steps_by_k() -> None:
    # K=2: 2 steps accepted nothing, 3 accepted one token, 5 accepted both;
    # 8 steps verified 2 drafts and 2 verified one (the autopilot capped them).
    metrics = SimpleNamespace(
        num_spec_tokens=2,
        histogram=[2, 3, 5],
        num_draft_tokens=18,
        per_step_drafted=[2] * 8 + [1] * 2,
    )
    # 30 tokens: 1 from the prefill, 13 accepted + 10 bonus from verify steps,
    # so 6 steps proposed nothing.
    stats = speculation_stats(metrics, tokens=30)
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (10, 18, 13)
    assert stats.accepted_per_position == [8, 5]
    assert stats.steps_by_k == {2: 8, 1: 2, 0: 6}


def test_lookup_counts_reach_the_request_whole_however_vllm_merges_outputs() -> None:
    """Each sequence's last output carries its finished siblings' counts too; vLLM keeps only
    the last transfer params of outputs it merges."""
    a = {"verified": 4, "accepted": 3, "steps": 2}
    b = {"verified": 5, "accepted": 1, "steps": 2}
    separate = FinishedLookups()
    separate.add({LOOKUP_COUNTS_PARAM: {"0_r": a}})
    assert separate.take() == (4, 3)
    separate.add(None)  # an output of another sequence, not its last
    separate.add({LOOKUP_COUNTS_PARAM: {"0_r": a, "1_r": b}})
    assert separate.take() == (5, 1)
    merged = FinishedLookups()
    merged.add({LOOKUP_COUNTS_PARAM: {"0_r": a, "1_r": b}})
    assert merged.take() == (9, 4)  # the first sequence of the merged output gets both
    assert merged.take() == (0, 0)
    metrics = SimpleNamespace(
        num_spec_tokens=2, histogram=[0, 1, 2], num_draft_tokens=6, per_step_drafted=[2] * 3
    )
    stats = speculation_stats(metrics, tokens=9, lookups=(4, 3))
    assert (stats.lookup_tokens, stats.lookup_accepted_tokens) == (4, 3)


def test_a_request_s_own_speculation_options_reach_the_scheduler() -> None:
    options = SamplingOptions(max_tokens=4, max_draft_tokens=2, lookups=False)
    assert scheduler_args(options, "t", "r-1") == {
        MAX_DRAFT_TOKENS_ARG: 2,
        NO_LOOKUPS_ARG: True,
        TENANT_ARG: "t",
        REQUEST_ARG: "r-1",
    }
    assert scheduler_args(SamplingOptions(max_tokens=4), None, None) is None
