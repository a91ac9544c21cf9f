"""Why the draft idles in an engine step (K=0): the one vocabulary of the autopilot's decisions,
the per-response `speculation.reason`, and the `reason` label of
`specserve_speculation_idle_steps_total`. Values are the strings clients and dashboards see."""

from enum import StrEnum


class IdleReason(StrEnum):
    NOT_PAYING = "not_paying"  # the cost model predicts no gain, or speculation measured slower
    BATCH_TOO_LARGE = "batch_too_large"  # fixed mode's cut-off, or the autopilot's at that batch
    TOO_SHORT = "too_short"  # the requests end before the draft's catch-up is paid back
    PREFILL = "prefill"  # every request of the step prefills, after steps of more requests
    CALIBRATING = "calibrating"  # measuring plain steps at a batch size
    DISABLED = "disabled"  # no speculation on this server
    LOGIT_BIAS = "logit_bias"  # the request has logit_bias (no drafts), as all of the step's had
    REQUESTED_OFF = "requested_off"  # every request asked for none (max_draft_tokens 0)
    LOOKUP = "lookup"  # every request of the step verifies looked-up tokens: no draft needed
