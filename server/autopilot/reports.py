"""The reports vLLM's engine processes send the front end, typed once for both ends: the
scheduler's (server/vllm_plugins/autopilot_scheduler.py) and the draft worker's
(server/vllm_plugins/draft_sync.py) as sent, and as the feed (feed.py) reads them. Totals are
cumulative since the process started; each datagram also carries its `source` and how many
of the sender's reports were dropped unsent (`dropped_reports`).
"""

from dataclasses import dataclass
from typing import NotRequired, TypedDict

# The largest report a sender sends and the front end reads whole (one Unix datagram). The
# scheduler's stays far below it at any max_num_seqs (its per-batch entries are bounded).
MAX_REPORT_BYTES = 65536


class VerifiedCounts(TypedDict):
    """Proposed tokens the target verified, accepted, and in how many verify steps."""

    verified: int
    accepted: int
    steps: int


@dataclass
class Verified:
    """A running count of VerifiedCounts, on the scheduler's side."""

    verified: int = 0
    accepted: int = 0
    steps: int = 0

    def add(self, verified: int, accepted: int) -> None:
        self.verified += verified
        self.accepted += accepted
        self.steps += 1

    def as_dict(self) -> VerifiedCounts:
        return {"verified": self.verified, "accepted": self.accepted, "steps": self.steps}


class SchedulerReport(TypedDict):
    """What the autopilot decided last and what it has measured."""

    mode: str  # "auto", "fixed" or "script"
    k: int  # the K of the last step
    reason: str | None  # why that K is 0 (an IdleReason value)
    probing: bool
    predicted_speedup: float
    measured_speedup: float | None
    end_to_end_speedup_by_batch: dict[str, float]
    realised_fraction_by_batch: dict[str, float]
    steps_by_k: dict[str, int]
    zero_steps_by_reason: dict[str, int]
    acceptance_by_position: list[float]
    expected_tokens_per_step: float
    cost_ready: bool
    draft_seconds_per_token: float | None
    verify_seconds_per_token: float | None
    plain_step_seconds: float | None
    step_spread_by_shape: dict[str, float]
    verified_by_source: dict[str, VerifiedCounts]  # "draft", and "lookup" with the hybrid
    # The hybrid's lookups only.
    lookup_by_origin: NotRequired[dict[str, VerifiedCounts]]  # "prompt", "replies"
    lookup_seconds_per_step: NotRequired[float]
    lookup_index_tokens: NotRequired[int]
    lookup_index_replies: NotRequired[int]


class DraftReport(TypedDict):
    """The draft model's work in the worker."""

    draft_forward_passes: int
    draft_caught_up_tokens: int
    draft_catch_up_passes: int
    draft_skipped_steps: int
