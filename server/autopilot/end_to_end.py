"""End to end at one batch size: output tokens per second of the steps that do extra work
(speculating, or verifying lookups) against plain steps, each side decayed. The one measure that
sees everything the extra work costs: the controller (policy.py) stops speculation by it, the
scheduler's lookups (server/vllm_plugins/scheduler_lookups.py) stop lookups by it, once it
reads slower (the draft's with confidence, see CONFIDENT). Stdlib only.
"""

import math
from dataclasses import dataclass

from server.autopilot.cost_model import MIN_STEP_SECONDS

# How the sides forget (for lookups, "speculating" is the steps that verified lookups):
# - The speculating side forgets at _SPECULATING_DECAY per step of its own (about the last 50)
#   and at _VETO_RECOVERY per plain step: the draft, stopped after 16 steps, retries after ~700
#   plain steps (below CONFIDENT's 8), and a retry of one step recurs every ~100; lookups,
#   stopped after 8 steps, retry after ~700 (below ON_THE_MEAN's 4), then every ~220. For
#   lookups it also forgets at _VETO_RECOVERY per step of neither side (one with draft work):
#   where they stopped, the draft runs instead and plain steps are few, so the retry would
#   otherwise never come.
# - The plain side forgets at _PLAIN_DECAY per plain step and at _PLAIN_STALENESS per
#   speculating step: where speculation runs throughout, one plain step every ~220 keeps the
#   comparison current (at a new batch size, five plain steps follow its first five).
_SPECULATING_DECAY = 0.98
_PLAIN_DECAY = 0.99
_PLAIN_STALENESS = 0.999
_VETO_MIN_STEPS = 4.0
_VETO_RECOVERY = 0.001
# How sure the measure must be before extra work stops there: (standard errors by which its
# tokens/s must read slower than plain steps', steps of its own at least).
# - The draft's (CONFIDENT): one-sided 95%, over 8 steps. Steps that speculate vary widely (one
#   token to K + 1), so a few early steps, one of them the draft catching up on a prompt, can
#   read slower by chance: stopping on the mean after 4 steps stopped a draft that truly
#   gained 1.2x in 48 of 100 simulated runs (1.5x: 11); with the confidence 2 (0), and a true
#   loss is still found, the larger the sooner (a median of 11 steps for 0.8x, 30 for 0.9x;
#   tests/unit/test_end_to_end.py).
# - The lookups' (ON_THE_MEAN): slower on the mean, over 4 steps. Where they pay (copies) they
#   make several times a plain step's tokens/s, never near the line; where they are near it,
#   stopping late costs: replayed over one run's prose at four requests, where lookup steps
#   made 0.84x of plain steps' tokens/s, the confident rule stopped them after 127 lookup
#   steps, on the mean after 55 (docs/benchmarks.md).
CONFIDENT = (1.645, 8.0)
ON_THE_MEAN = (0.0, _VETO_MIN_STEPS)


@dataclass
class _Side:
    """Decayed output tokens, seconds and steps of one batch size's speculating or plain steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    # For the rate's standard error: decayed squares and products, and squared weights.
    tokens_squared: float = 0.0
    seconds_squared: float = 0.0
    tokens_seconds: float = 0.0
    weights_squared: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.fade(decay)
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1.0
        self.tokens_squared += tokens * tokens
        self.seconds_squared += seconds * seconds
        self.tokens_seconds += tokens * seconds
        self.weights_squared += 1.0

    def fade(self, factor: float) -> None:
        self.tokens *= factor
        self.seconds *= factor
        self.steps *= factor
        self.tokens_squared *= factor
        self.seconds_squared *= factor
        self.tokens_seconds *= factor
        self.weights_squared *= factor * factor

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def relative_variance(self) -> float:
        """The squared relative standard error of the rate (a ratio estimate: its steps'
        residuals tokens - rate x seconds, over their effective number)."""
        rate = self.rate
        squares = self.tokens_squared - 2.0 * rate * self.tokens_seconds
        residual = (squares + rate * rate * self.seconds_squared) / self.steps
        effective_steps = self.steps * self.steps / self.weights_squared
        mean_seconds = self.seconds / self.steps
        return max(residual, 0.0) / (effective_steps * (mean_seconds * rate) ** 2)


class EndToEnd:
    """Per batch size, the decayed trying and plain sides, and their ratio."""

    def __init__(self, confidence: tuple[float, float]) -> None:
        self._sides: dict[int, tuple[_Side, _Side]] = {}  # batch size -> (trying, plain)
        self._standard_errors, self._confident_steps = confidence  # CONFIDENT or ON_THE_MEAN

    def observe(self, batch: int, tokens: int, seconds: float, trying: bool) -> None:
        trying_side, plain_side = self._sides.setdefault(batch, (_Side(), _Side()))
        seconds = max(seconds, MIN_STEP_SECONDS)
        if trying:
            trying_side.add(tokens, seconds, _SPECULATING_DECAY)
            plain_side.fade(_PLAIN_STALENESS)
        else:
            plain_side.add(tokens, seconds, _PLAIN_DECAY)
            trying_side.fade(1.0 - _VETO_RECOVERY)

    def neither(self, batch: int) -> None:
        """A step at this batch size on neither side: the trying side forgets as on a plain
        step."""
        sides = self._sides.get(batch)
        if sides is not None:
            sides[0].fade(1.0 - _VETO_RECOVERY)

    def speedup(self, batch: int) -> float | None:
        """Tokens/s trying over tokens/s plain at this batch size (None: fewer than
        _VETO_MIN_STEPS steps of either yet)."""
        sides = self._sides.get(batch)
        if sides is None or min(side.steps for side in sides) < _VETO_MIN_STEPS:
            return None
        trying, plain = sides
        if not plain.tokens:
            return None
        return trying.rate / plain.rate

    def slower(self, batch: int) -> bool:
        """Extra work measured slower than plain steps at this batch size, as sure as this
        measure's confidence asks."""
        speedup = self.speedup(batch)
        if speedup is None:
            return False
        trying, plain = self._sides[batch]
        if trying.steps < self._confident_steps:
            return False
        if speedup == 0.0:
            return True
        error = math.sqrt(trying.relative_variance() + plain.relative_variance())
        return math.log(speedup) + self._standard_errors * error < 0.0

    @property
    def speedups(self) -> dict[int, float]:
        """The speedup of every batch size with enough steps of both."""
        speedups = {batch: self.speedup(batch) for batch in sorted(self._sides)}
        return {batch: speedup for batch, speedup in speedups.items() if speedup is not None}

    def needs_plain_steps(self, batch: int) -> bool:
        """Trying was measured at this batch size, too few plain steps to compare with."""
        sides = self._sides.get(batch)
        if sides is None:
            return False
        trying, plain = sides
        return trying.steps >= _VETO_MIN_STEPS and plain.steps < _VETO_MIN_STEPS

    def forget(self, batch: int) -> None:
        self._sides.pop(batch, None)
