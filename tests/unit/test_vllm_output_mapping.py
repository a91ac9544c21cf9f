"""How vLLM's per-sequence outputs map onto the engine contract (no engine needed)."""

from types import SimpleNamespace

import pytest

from server.engine.vllm_outputs import finish_reason, speculation_stats
from server.errors import EngineUnavailableError, InternalError


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
