"""How vLLM's per-sequence outputs map onto the engine contract (no engine needed)."""

from types import SimpleNamespace

import pytest

from server.engine.vllm_engine import _finish_reason, _speculation_stats
from server.errors import EngineUnavailableError, InternalError


@pytest.mark.parametrize(
    ("reason", "mapped"),
    [("stop", "stop"), ("length", "length"), ("repetition", "stop"), (None, None)],
)
def test_finish_reasons_use_openai_vocabulary(reason: str | None, mapped: str | None) -> None:
    assert _finish_reason(reason) == mapped


@pytest.mark.parametrize(
    ("reason", "error"), [("error", InternalError), ("abort", EngineUnavailableError)]
)
def test_engine_failures_become_errors(reason: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        _finish_reason(reason)


def test_speculation_histogram_folds_into_per_position_counts() -> None:
    # K=2: 2 steps accepted nothing, 3 accepted one token, 5 accepted both.
    metrics = SimpleNamespace(num_spec_tokens=2, histogram=[2, 3, 5], num_draft_tokens=20)
    stats = _speculation_stats(metrics)
    assert stats is not None
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (10, 20, 13)
    assert stats.accepted_per_position == [8, 5]
    assert _speculation_stats(None) is None
