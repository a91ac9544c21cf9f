"""The speculation autopilot's policy: how many draft tokens (K) to propose each engine step.

Owns the decision and what it rests on, with nothing that touches an engine (stdlib only):
- CostModel: this machine's step time as a linear function of the step's shape, fitted online,
  and what the draft's catch-up over positions it missed costs per token;
- AcceptanceTracker: per-position draft acceptance of the live traffic, overall and per request;
- Controller: the K with the most expected output tokens per second, the draft's catch-up on
  arriving requests' prompts included (0 when speculation does not pay, or when the requests end
  before the draft's catch-up is paid back), per-request caps on
  verified drafts, the startup calibration cycle, forgetting what a batch size measured when
  its steps change pace (a neighbour on the cores came or went), and the probes that keep a
  stale "off" from lasting forever.
The vLLM glue (server/engine/autopilot_scheduler.py) feeds it measurements and applies Decisions.
"""

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

_MIN_STEP_SECONDS = 1e-6
# Steady steps kept per measured shape. Its time is their low median: step times are noisy
# upwards (on a 2-core CPU the first decode step after a 317-token prefill took 1.75x the usual),
# so one slow step does not define a shape once a second sample exists.
_SHAPE_SAMPLES = 5
# Pull toward the previous fit. Features are O(1)..O(B*K) and the window holds ~100 steps, so
# this is negligible wherever the window has data and only holds the directions it leaves open
# (a batch size or a K not seen lately) at their last estimate.
_RIDGE = 1e-3
# The long-run fit's memory: a step's weight halves every ~700 steps (minutes of traffic).
_LONG_FORGETTING = 0.999
# What the long-run fit weighs in the window's, per feature: as many steps as this, each with
# the largest value of the feature seen. In a window of K = 0 steps only the rare resumption
# prices the draft and its catch-up; without this, each one alone set those costs (seen on a
# 2-core CPU: the draft's cost per pass swung from 0.06 to 0.3 s within minutes, and 0.87 s
# after an hour).
_PRIOR_STEPS = 2.0
# Acceptance before any data: optimistic enough that a cheap draft gets tried, honest in that
# it is below what code reaches (~0.9) and about what prose does.
_PRIOR_RATE = 0.5
# Weight of each request of a steady speculating step in the realised fraction of predicted
# speedups at its batch size (a step of one request: half-life ~14 steps; of eight, under 2 steps,
# since it measures eight requests' tokens at once; at most _REALISED_MAX_WEIGHT), and how fast
# the fraction returns to 1 while K stays 0 there (half-life ~350 steps), so one bad stretch does
# not keep speculation off for good. Recovery this slow against learning that fast bounds the
# retries: where steps realise 0.6 of the prediction, speculation runs in under 10% of steps.
_REALISED_WEIGHT = 0.05
_REALISED_MAX_WEIGHT = 0.5
_REALISED_RECOVERY = 0.002
# End to end at one batch size: output tokens over seconds of every step while it speculates
# (catch-ups, K changes and the draft's work in prefill steps included) against the same while
# it does not: the one measure that sees everything speculation costs. On a 2-core CPU, code at
# four requests realised 0.95 of its steady steps' predictions and ran 0.95x of K = 0 overall;
# the rest went in steps the model does not see as it runs them. Where speculation measures
# slower than K = 0, it stops at that batch size.
# - Prefill steps count on both sides less what the target's prefill costs (learnt from plain
#   prefill steps), so that a side measured over more prefills does not read slower for it.
# - The speculating side forgets at _SPECULATING_DECAY per step of its own (about the last 50)
#   and at _VETO_RECOVERY per plain step: a batch size stopped after 8 steps retries after ~700
#   plain steps, and a retry of one step recurs every ~220.
# - The plain side forgets at _PLAIN_DECAY per plain step and at _PLAIN_STALENESS per
#   speculating step: where speculation runs throughout, one plain step every ~220 keeps the
#   comparison current (at a new batch size, five plain steps follow its first five).
_SPECULATING_DECAY = 0.98
_PLAIN_DECAY = 0.99
_PLAIN_STALENESS = 0.999
_VETO_MIN_STEPS = 4.0
_VETO_RECOVERY = 0.001
_PREFILL_LEARNING = 0.1  # weight of each plain prefill step in the target's prefill cost
# The machine's pace: where a settled step at a batch size (the low median of its shape's own
# full set of samples) stays this far from when it first settled, either way, for as many new
# samples as a full set, what was measured at that batch size describes another machine (a
# neighbour on the cores came or went): its shapes, its end-to-end sides and its realised
# fraction are forgotten and measured again as traffic runs, and probes restart from the
# shortest interval. Otherwise steps measured beside a neighbour that slowed the draft more than
# the target (a compile on the same two cores) kept K at 0, or at a K too small, for hundreds of
# steps after it left. A quiet machine moves as much, but not for as long: on a 2-core CPU, over
# six code requests, a K = 4 shape's low median moved by 0.85-1.33x and the plain step's by
# 0.99-1.06x, and a band of 1.1 for any one excursion sent 23% of the steps to measuring again.
# Steps with drafts vary more with the draft's work than plain steps: they have a wider band.
_PACE_CHANGE = 1.1
_DRAFTING_PACE_CHANGE = 1.25
# A probe's catch-up is paid from this share of the time spent at K = 0 since the last probe
# (or since speculation stopped). The draft catches up on every request's whole context: on a
# 2-core CPU, two 80-token prose contexts took ~2.5 s, seven plain steps, and rounds of prose at
# two requests with probes 16-64 steps apart ran at 0.89-0.95x of K = 0. At 2%, probes cost at
# most 2% of the time speculation is off, at the price of a later probe (there, ~2 minutes).
_PROBE_CATCH_UP_BUDGET = 0.02
# Steps whose batch sizes say whether requests have lately run together: a step of prefills
# only drafts if none of them had more requests than it (see Controller.choose).
_PREFILL_LOOKBACK_STEPS = 32
# Output tokens a request is expected to still produce, at most, when pricing the draft's
# catch-up against what speculation saves: a large max_tokens is a cap, not a promise (EOS).
_HORIZON_TOKENS = 256


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the scheduler saw it."""

    duration: float  # seconds, from the end of schedule() to update_from_output()
    batch_size: int  # requests in the step
    verified_tokens: int  # draft tokens the target verified in this step, summed over requests
    proposed_k: int  # K the draft proposed at the end of this step (0: the draft did not run)
    prefill_tokens: int  # prompt tokens computed in the step (0 for a pure decode step)
    caught_up_tokens: int = 0  # positions the draft caught up on before proposing (K > 0 only)


@dataclass(frozen=True)
class _ShapeSample:
    """One steady step of a measured shape, and what it is read against later."""

    seconds: float
    plain: float  # the plain step's time at its batch size when it was taken (K = 0: seconds)


def _features(batch_size: int, verified: int, proposed: int, caught_up: int = 0) -> list[float]:
    # Step time = a + b*B + c*V + P*(d + e*B) + u*U: fixed cost, each request's own token, each
    # verified draft, P draft passes with a fixed and a per-request part, and each position the
    # draft catches up on after idling.
    return [
        1.0,
        float(batch_size),
        float(verified),
        float(proposed),
        float(proposed * batch_size),
        float(caught_up),
    ]


_NUM_FEATURES = len(_features(1, 0, 0))


class CostModel:
    """Step time as a linear function of the step's shape, fitted by recency-weighted
    least squares on this machine's own measured steps; no constants from another machine.

    Least squares over the last (1 + f) / (1 - f) decode steps (99 for f = 0.98: the window
    with forgetting f's effective sample count and mean age), not RLS with forgetting: after a
    change (the draft gets slower) forgetting keeps the old steps at small weights for ~5/(1-f)
    steps, and extrapolating from the K in use to K = 0 turns that small disagreement into a
    wrong baseline (a slower draft read as a slower target; in a simulated trace speculation
    seemed to pay for 150-270 steps after it stopped paying). A window drops old steps after
    99. Directions the window leaves open or holds few steps in are held near a long-run fit
    (exponential forgetting over ~1000 steps) by a ridge worth _PRIOR_STEPS steps.
    """

    def __init__(self, forgetting: float = 0.98) -> None:
        if not 0.0 < forgetting < 1.0:
            raise ValueError(f"forgetting must be in (0, 1), got {forgetting}")
        self._window = round((1.0 + forgetting) / (1.0 - forgetting))
        self._steps: deque[tuple[list[float], float]] = deque()
        # Features are integers: adding and dropping steps keeps this exact however long it runs.
        self._gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
        self._moment = [0.0] * _NUM_FEATURES
        self._theta = [0.0] * _NUM_FEATURES  # a, b, c, d, e, u
        self._long_gram = [[0.0] * _NUM_FEATURES for _ in range(_NUM_FEATURES)]
        self._long_moment = [0.0] * _NUM_FEATURES
        self._long_theta = [0.0] * _NUM_FEATURES
        self._scale = [0.0] * _NUM_FEATURES  # the largest value of each feature seen
        self._ready = False
        self._shapes: dict[int, set[tuple[int, int]]] = {}  # batch size -> (V, P) seen, until ready
        # (batch size, K) -> the last few steady steps of that shape (every request verified
        # K, the draft proposed K, caught up on nothing). Kept when the window moves on: step
        # time is not linear in the batch (rows are nearly free until the matmuls turn
        # compute-bound, then cost in full), so a measured shape (the startup calibration
        # measures K = 0..k_max at two batch sizes) beats extrapolating from others. See
        # _measured_seconds for how they are read.
        self._measured: dict[tuple[int, int], deque[_ShapeSample]] = {}
        self._taken: Counter[tuple[int, int]] = Counter()  # steady steps ever seen per shape

    def observe(self, step: StepRecord) -> None:
        if step.prefill_tokens > 0 or step.batch_size <= 0:
            return  # prefill cost is not decode cost
        if len(self._steps) == self._window:
            self._add(*self._steps.popleft(), sign=-1.0)
        x = _features(step.batch_size, step.verified_tokens, step.proposed_k, step.caught_up_tokens)
        self._steps.append((x, step.duration))
        self._add(x, step.duration, sign=1.0)
        self._add_long(x, step.duration)
        self._scale = [max(scale, xi) for scale, xi in zip(self._scale, x, strict=True)]
        ridge = [_RIDGE] * _NUM_FEATURES
        self._long_theta = _ridge_solve(self._long_gram, self._long_moment, ridge, self._long_theta)
        prior = self._theta
        if self._ready:
            ridge = [_RIDGE + _PRIOR_STEPS * scale * scale for scale in self._scale]
            prior = self._long_theta
        self._theta = _ridge_solve(self._gram, self._moment, ridge, prior)
        if step.caught_up_tokens > 0:
            return  # prices the catch-up; not a shape the readiness or the measured times use
        if not self._ready:
            shapes = self._shapes.setdefault(step.batch_size, set())
            shapes.add((step.verified_tokens, step.proposed_k))
            self._ready = _spans_plane(shapes)
            if self._ready:
                self._shapes.clear()
                self._theta = _assume_batch_split(self._theta, step.batch_size)
                self._long_theta = list(self._theta)
                # Taken before there was a fit: they start from what it says now.
                self._measured = {
                    shape: deque(
                        [self._sample(shape, sample.seconds) for sample in samples],
                        maxlen=_SHAPE_SAMPLES,
                    )
                    for shape, samples in self._measured.items()
                }
        if step.verified_tokens == step.batch_size * step.proposed_k:
            shape = (step.batch_size, step.proposed_k)
            samples = self._measured.setdefault(shape, deque(maxlen=_SHAPE_SAMPLES))
            samples.append(self._sample(shape, step.duration))
            self._taken[shape] += 1

    def _sample(self, shape: tuple[int, int], seconds: float) -> "_ShapeSample":
        batch_size, k = shape
        return _ShapeSample(seconds, self._shape_seconds(batch_size, 0) if k else seconds)

    def _add(self, x: list[float], seconds: float, sign: float) -> None:  # one step in or out
        for i, xi in enumerate(x):
            self._moment[i] += sign * xi * seconds
            for j, xj in enumerate(x):
                self._gram[i][j] += sign * xi * xj

    def _add_long(self, x: list[float], seconds: float) -> None:
        for i, xi in enumerate(x):
            self._long_moment[i] = _LONG_FORGETTING * self._long_moment[i] + xi * seconds
            row = self._long_gram[i]
            for j, xj in enumerate(x):
                row[j] = _LONG_FORGETTING * row[j] + xi * xj

    @property
    def ready(self) -> bool:
        """Three (V, P) shapes off one line at one batch size (where the features reduce to
        [1, V, P]) pin the plain step, verify and draft costs there; _assume_batch_split spreads
        them over other batch sizes until those are measured. A calibration cycle has them after
        five steps: (0, 0), (0, 0), (0, 1) (the draft catches up: priced, not counted here),
        (1, 1), (1, 2). Stays true once reached."""
        return self._ready

    def _measured_seconds(self, shape: tuple[int, int]) -> float:
        """The low median of the shape's samples. The plain step (K = 0) keeps its samples as
        they are: it is measured whenever speculation is off, and reading another shape's
        misfit into it would inflate the baseline speculation is judged against, which nothing
        measures again while speculation stays on. A sample with drafts is the plain step of
        its batch size then plus what its drafts cost: it moves with that plain step (the
        machine slowed, the contexts grew), not with the fit, which rounds at other batch sizes
        bend (on a 2-core CPU, after rounds at 4 and 8 requests, K = 2 at one request measured
        at 1.5x a plain step read 1.9x when moved by the fit's change). What drafts cost is
        measured again by every steady step of the shape."""
        samples = self._measured[shape]
        if shape[1] == 0:
            return _low_median([sample.seconds for sample in samples])
        plain = self._shape_seconds(shape[0], 0)
        return _low_median([sample.seconds + plain - sample.plain for sample in samples])

    def forget_shapes(self, batch_size: int) -> None:
        """Drop the measured shapes at this batch size (they are measured again)."""
        for shape in [shape for shape in self._measured if shape[0] == batch_size]:
            del self._measured[shape]

    def samples_taken(self, shape: tuple[int, int]) -> int:
        """Steady steps of this shape seen since startup (forgetting does not reset it)."""
        return self._taken[shape]

    def settled_seconds(self, shape: tuple[int, int]) -> float | None:
        """The low median of the shape's own step times once it holds its full count of
        samples (None before): what the machine's pace is read from, apart from other
        shapes."""
        samples = self._measured.get(shape, ())
        if len(samples) < _SHAPE_SAMPLES:
            return None
        return _low_median([sample.seconds for sample in samples])

    def spread(self) -> dict[str, float]:
        """Each measured shape's spread, "BxK": (slowest - fastest) / median of its samples.
        Read after the startup calibration (two or three samples of each shape), it says how
        far apart repeated cycles measured the same step: what the startup estimate is worth."""
        spreads = {}
        for (batch_size, k), samples in sorted(self._measured.items()):
            seconds = [sample.seconds for sample in samples]
            if len(seconds) >= 2:
                spreads[f"{batch_size}x{k}"] = (max(seconds) - min(seconds)) / _low_median(seconds)
        return spreads

    def _is_measured(self, shape: tuple[int, int]) -> bool:
        """Enough samples to stand for the shape: two for the plain step, so that one slow
        step at a new batch size cannot read as a slow baseline and turn speculation on there
        (the second costs nothing: K = 0 is what runs meanwhile); one for K > 0, whose errors
        are on the side of caution or corrected by the steps they lead to."""
        samples = self._measured.get(shape)
        return samples is not None and len(samples) >= (2 if shape[1] == 0 else 1)

    def predict(self, batch_size: int, k: int) -> float:
        """Steady-state step time: every request verifies k drafts and the draft proposes k.

        A measured shape (see _is_measured) is its measured time (see _measured_seconds);
        between two measured batch sizes at this K, the line through them; beyond the measured
        ones, the nearest plus the fit's difference, because the fit's slope rests on every
        step in its window while two nearby sizes' slope is noise times the distance (on a
        2-core CPU a line through batch 3 and 4 put K=2 at batch 8 under K=1, and speculation
        turned on at 8 requests at 0.8x); with nothing measured at this K, the fit.

        A step with drafts does all a plain step does and more, so K > 0 is never put below
        K = 0. A measured shape moves with its plain step since it was measured, and a plain
        step far off then (calibrated while the machine was busy: steps 3-4x their usual time)
        moves it by as much: on a 2-core CPU samples of K = 3 taken at 0.3 s against a plain
        step of 0.6 s would read below 0 s once the plain step is measured at its usual time.
        """
        seconds = self._shape_seconds(batch_size, k)
        if k > 0:
            seconds = max(seconds, self._shape_seconds(batch_size, 0))
        return max(seconds, _MIN_STEP_SECONDS)

    def _shape_seconds(self, batch_size: int, k: int) -> float:
        """predict() before its floor at the plain step."""
        sizes = sorted(
            size
            for size, shape_k in self._measured
            if shape_k == k and self._is_measured((size, k))
        )
        below = [size for size in sizes if size < batch_size]
        above = [size for size in sizes if size > batch_size]
        if batch_size in sizes:
            seconds = self._measured_seconds((batch_size, k))
        elif below and above:
            b0, b1 = below[-1], above[0]
            t0, t1 = self._measured_seconds((b0, k)), self._measured_seconds((b1, k))
            seconds = t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
        elif sizes:
            nearest = below[-1] if below else above[0]
            seconds = (
                self._measured_seconds((nearest, k))
                + self._fit(batch_size, k)
                - self._fit(nearest, k)
            )
        else:
            seconds = self._fit(batch_size, k)
        return seconds

    def _fit(self, batch_size: int, k: int) -> float:
        features = _features(batch_size, batch_size * k, k)
        return sum(t * x for t, x in zip(self._theta, features, strict=True))

    def catch_up_seconds(self, tokens: int) -> float:
        """What the draft catching up on `tokens` missed positions adds to a step."""
        return max(self._theta[5], 0.0) * tokens

    def draft_seconds_per_token(self, batch_size: int) -> float:
        return max(self._theta[3] + self._theta[4] * batch_size, 0.0)

    def verify_seconds_per_token(self) -> float:
        return max(self._theta[2], 0.0)


def _assume_batch_split(theta: list[float], batch_size: int) -> list[float]:
    """theta with the split between fixed and per-request costs set by assumption, keeping what
    one batch size B measures: the plain step a + b*B, the verify cost c, the draft step
    d + e*B. Assumed: a request's own token costs the target what a verified draft does
    (b = c: both are rows of the same forward pass), and the per-request part of a draft step
    is the same share of it as in a target step (e*B / (d + e*B) = b*B / (a + b*B)).
    """
    a, b, c, d, e, u = theta
    step, draft = a + b * batch_size, d + e * batch_size
    row = min(max(c, 0.0), max(step, 0.0) / batch_size)
    draft_row = draft * row / step if step > 0 else 0.0
    return [step - row * batch_size, row, c, draft - draft_row * batch_size, draft_row, u]


def _low_median(values: list[float]) -> float:
    """The median, or the lower middle value of an even count."""
    return sorted(values)[(len(values) - 1) // 2]


def _ridge_solve(
    gram: list[list[float]], moment: list[float], ridge: list[float], prior: list[float]
) -> list[float]:
    """Least squares pulled toward `prior` with weight ridge[i] on coefficient i."""
    matrix = [[g + ridge[i] * (i == j) for j, g in enumerate(row)] for i, row in enumerate(gram)]
    rhs = [m + r * p for m, r, p in zip(moment, ridge, prior, strict=True)]
    return _solve(matrix, rhs)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the system is small and positive definite)."""
    n = len(rhs)
    rows = [[*row, value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n + 1):
                rows[r][c] -= factor * rows[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (rows[r][n] - sum(rows[r][c] * x[c] for c in range(r + 1, n))) / rows[r][r]
    return x


def _spans_plane(points: set[tuple[int, int]]) -> bool:
    """True when the points are not all on one line."""
    (v0, p0), *rest = points
    return any((v1 - v0) * (p2 - p0) != (v2 - v0) * (p1 - p0) for v1, p1 in rest for v2, p2 in rest)


@dataclass
class _Counts:
    """Recency-weighted counts per draft position: times reached, times accepted."""

    reached: list[float]
    accepted: list[float]

    def add(self, verified: int, accepted: int, decay: float) -> None:
        for p in range(len(self.reached)):
            self.reached[p] = decay * self.reached[p] + float(p < verified and p <= accepted)
            self.accepted[p] = decay * self.accepted[p] + float(p < accepted)


class AcceptanceTracker:
    """Per-position conditional acceptance a_p = P(position p accepted | positions < p accepted),
    over the live traffic, overall and per request, recency weighted (half-life in verify steps).

    Each observe() ages the request's own counts and the overall counts by one verify step;
    steps that verify nothing age nothing (there is no news about acceptance in them).

    prior_strength is in verify steps. 6 (a request's estimate held nearer the traffic's, so a
    lucky streak of a prose request buys less) looked better in a simulation and was worse on
    a 2-core CPU: code at 1, 2 and 4 requests ran 1.23x, 1.02x and 0.94x of K = 0 against
    1.33x, 1.09x and 0.98x with 2 (8 rounds each, within each other's intervals; prose alike).
    """

    def __init__(
        self, k_max: int, half_life_steps: float = 16.0, prior_strength: float = 2.0
    ) -> None:
        if k_max < 0 or half_life_steps <= 0 or prior_strength <= 0:
            raise ValueError("k_max must be >= 0, half_life_steps and prior_strength > 0")
        self._k_max = k_max
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._prior_strength = prior_strength
        self._overall = _Counts([0.0] * k_max, [0.0] * k_max)
        self._requests: dict[str, _Counts] = {}

    def observe(self, request_id: str, verified: int, accepted: int) -> None:
        """One verify step of one request: the first `accepted` of `verified` drafts passed."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"need 0 <= accepted <= verified, got {accepted}, {verified}")
        if verified == 0:
            return
        counts = self._requests.setdefault(
            request_id, _Counts([0.0] * self._k_max, [0.0] * self._k_max)
        )
        counts.add(verified, accepted, self._decay)
        self._overall.add(verified, accepted, self._decay)

    def position_rates(self, request_id: str | None = None) -> list[float]:
        """k_max conditional rates, overall or for one request (unknown requests get overall).

        Each rate is its counts blended with prior_strength pseudo-counts of a prior: overall,
        position p's prior is position p-1's rate (0.5 for the first), so a position never
        reached carries the last reached one's rate forward; a request's position p's prior is
        the traffic's rate at p.
        """
        s = self._prior_strength
        overall: list[float] = []
        prior = _PRIOR_RATE
        for reached, accepted in zip(self._overall.reached, self._overall.accepted, strict=True):
            prior = (accepted + s * prior) / (reached + s)
            overall.append(prior)
        if request_id is None:
            return overall
        # A request is judged by its own drafts. Until it has some, it is assumed to be like
        # the traffic (a short request would end before its own rate shows; a prose request in
        # code traffic costs a few drafted steps, after which its own misses at the first
        # positions outweigh the prior, and those bound every deeper one's worth). Each
        # position is shrunk toward the traffic's at that position, not toward its own
        # previous one: with that chain, one draft rejected at the second position of a code
        # request whose drafts are accepted ~95% of the time took its third and fourth down
        # with it (0.96, 0.73, 0.73, 0.73), and it ran at K = 1-2 for several steps
        # where K = 4 pays most (on an AVX-512 CPU, fixed K = 4 ran code at one request
        # 1.59x of K = 0, auto 1.32x).
        own = self._requests.get(request_id)
        if own is None:
            return overall
        return [
            (accepted + s * prior) / (reached + s)
            for reached, accepted, prior in zip(own.reached, own.accepted, overall, strict=True)
        ]

    def forget(self, request_id: str) -> None:
        """The request finished: drop its state (memory stays bounded by the live requests)."""
        self._requests.pop(request_id, None)


def _pays_back(catch_up: float, tokens_left: float, baseline: float, faster: float) -> bool:
    """Does producing tokens_left at the faster rate instead of baseline (tokens/s) save more
    than catch_up seconds? (Nothing to catch up on always pays back.)"""
    if catch_up <= 0.0:
        return faster > baseline
    return tokens_left * (1.0 / baseline - 1.0 / faster) >= catch_up


def _tokens_by_k(rates: list[float], k_max: int) -> list[float]:
    """Expected tokens per step for K = 0..k_max (see expected_tokens_per_step)."""
    tokens = [1.0]
    all_accepted = 1.0
    for rate in rates[:k_max]:
        all_accepted *= rate
        tokens.append(tokens[-1] + all_accepted)
    return tokens


def _capped(tokens: list[float], k_max: int) -> list[float]:
    """Expected tokens per step for K = 0..k_max of a request that verifies at most
    len(tokens) - 1 drafts: K past its cap yields what its cap does."""
    return [tokens[min(k, len(tokens) - 1)] for k in range(k_max + 1)]


def expected_tokens_per_step(rates: list[float], k: int) -> float:
    """1 + sum_{j=1..k} prod_{p<j} rates[p] (bonus token included)."""
    return _tokens_by_k(rates, k)[k]


@dataclass
class _Side:
    """Decayed output tokens, seconds and steps of one batch size's speculating or plain steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps = decay * self.steps + 1.0

    def fade(self, factor: float) -> None:
        self.tokens, self.seconds, self.steps = (
            factor * self.tokens,
            factor * self.seconds,
            factor * self.steps,
        )


@dataclass(frozen=True)
class RequestState:
    """What the scheduler knows of one request of the next step. The defaults are a request
    the controller knows nothing of: in step, the horizon left, no prompt, no cap."""

    behind: int = 0  # positions its draft must catch up on if K > 0 (0 when in step)
    tokens_left: int = _HORIZON_TOKENS  # output tokens it may still produce
    prompt_tokens: int = 0  # its prompt's length (what the draft catches up on at its start)
    max_tokens: int = _HORIZON_TOKENS  # the most output tokens its whole reply may have
    draft_cap: int | None = None  # the most drafts it asked to verify per step
    prefilling: bool = False  # its prompt (or the rest of it) is computed in this step


@dataclass(frozen=True)
class Decision:
    """What the scheduler applies for one step."""

    k: int  # K for this step (what the draft proposes)
    per_request_k: dict[str, int]  # each request's cap on drafts it verifies next step (<= k)
    # None if k > 0, else not_paying, batch_too_large, too_short, prefill, disabled, calibrating, or
    # logit_bias (set by the scheduler: a biased request must get no drafts) or requested_off
    # (set by the scheduler: every request of the step asked for none)
    reason: str | None
    predicted_speedup: float  # predicted tokens/s at k over tokens/s at k=0 (1.0 when unknown)
    probing: bool  # this k is a probe (or calibration), not the optimum


class Controller:
    """Each step, the K in 0..k_max with the most predicted output tokens per second.

    K > 0 only when it beats K = 0 by min_gain, a margin for the noise in the estimates: what
    steady predictions miss is measured and taken off before it (the realised fraction and the
    end-to-end check below); at 10% the margin discounted that a second time, and on a 2-core
    CPU prose at one request speculated in 17% of steps where fixed K = 2 ran 1.23x as fast
    as K = 0. The predicted speedup is first scaled by the fraction
    of it that steady speculating steps at the same batch size have realised (see realised(),
    at most 1): choosing the requests whose acceptance estimate is high picks some that are
    high by chance, and the model's step times can be off, so on prose at one request the model
    predicted 1.1-1.2x where the steps realised ~0.9 of it, and at eight code requests it
    predicted a gain for whole rounds of steps that ran 0.69-0.96x as fast as K = 0. And only
    when what it saves over the requests' remaining tokens pays for the draft catching up on
    the positions it missed while idle (its share of a new prompt included): a short request
    does not pay back a long prompt's catch-up ("too_short"). Tokens per second at K > 0 count
    the catch-up on the prompts of the requests that will replace these ones (see
    _arrivals_seconds): each request's speedup pays for its own prompt's catch-up, so a batch
    of short replies to long prompts, where a new request joins every few steps, stays at K = 0.
    Last, what the model predicts is checked against what was measured end to end at the same
    batch size (see end_to_end()): where speculating steps made fewer tokens per second than
    plain ones, K stays 0 there until that evidence fades; a batch size that speculated with too
    few plain steps to compare against runs K = 0 to measure them ("calibrating").
    While K stays 0 nothing is verified, so every probe interval one step runs the best K >= 1
    to let acceptance show it recovered, if even perfect acceptance could pay back that step's
    catch-up (otherwise the probe could not change the answer) and the catch-up fits in a
    budget of 2% of the time spent off since the last probe (it is the probe's main cost: the
    draft catches up on every request's context). The interval doubles while probes leave K
    at 0 (overhead ~1/interval where speculation never pays), resets when it resumes.
    """

    def __init__(
        self,
        k_max: int,
        cost: CostModel,
        acceptance: AcceptanceTracker,
        *,
        min_gain: float = 0.05,
        probe_interval_steps: int = 16,
        max_probe_interval_steps: int = 512,
    ) -> None:
        if k_max < 0 or min_gain < 0 or not 1 <= probe_interval_steps <= max_probe_interval_steps:
            raise ValueError("need k_max >= 0, min_gain >= 0, 1 <= probe interval <= max")
        if len(acceptance.position_rates()) < k_max:
            raise ValueError("the acceptance tracker tracks fewer positions than k_max")
        self._k_max = k_max
        self._cost = cost
        self._acceptance = acceptance
        self._min_gain = min_gain
        self._base_interval = probe_interval_steps
        self._max_interval = max_probe_interval_steps
        self._probe_interval = probe_interval_steps
        self._calibration_steps = 0
        # (batch size, K) -> that shape's settled time since its batch size was last forgotten
        self._pace: dict[tuple[int, int], float] = {}
        # (batch size, K) -> samples_taken when that shape's settled time left its band
        self._outside_since: dict[tuple[int, int], int] = {}
        self._off_steps = 0  # K = 0 steps since speculation stopped or since the last probe
        self._off_seconds = 0.0  # their predicted time
        # batch size -> measured over predicted speedup of its steady speculating steps
        self._realised: dict[int, float] = {}
        # batch size -> its (speculating, plain) steps, see end_to_end()
        self._end_to_end: dict[int, tuple[_Side, _Side]] = {}
        self._prefill_seconds_per_token: float | None = None  # the target's, at K = 0
        self._recent_batches: deque[int] = deque(maxlen=_PREFILL_LOOKBACK_STEPS)

    def choose(self, requests: Mapping[str, RequestState]) -> Decision:
        """K for the next step of these requests (request id -> what the scheduler knows)."""
        request_ids = list(requests)
        if self._k_max == 0:
            return Decision(0, dict.fromkeys(request_ids, 0), "disabled", 1.0, False)
        if not request_ids:
            return Decision(0, {}, "not_paying", 1.0, False)  # nothing to decode
        if not self._cost.ready:
            return self._calibrate(request_ids)
        batch = len(request_ids)
        lately = max(self._recent_batches, default=batch)
        self._recent_batches.append(batch)
        if lately > batch and all(state.prefilling for state in requests.values()):
            # Requests that arrive together reach the engine a few milliseconds apart: the
            # first is prefilled alone and the rest join it one step later. Drafted for at
            # the batch size of one, its drafts would be verified at the batch size of all
            # (on a 2-core CPU, rounds of four code requests lost 7%: ~1 s of draft work per
            # round, before a K = 0 the rest of the round). Where requests have not run
            # together lately, the prefill step drafts: idle there, the draft catches up on the
            # whole prompt in the next step, which then verifies nothing (on a 2-core CPU, one
            # code request of 32 tokens spent 15% of its time on that step).
            return Decision(0, dict.fromkeys(request_ids, 0), "prefill", 1.0, False)
        if self._pace_changed(batch):
            self._forget_measurements(batch)
        catch_up = self._cost.catch_up_seconds(sum(state.behind for state in requests.values()))
        left = sum(min(state.tokens_left, _HORIZON_TOKENS) for state in requests.values())
        requested = {
            r: min(self._k_max, self._k_max if state.draft_cap is None else state.draft_cap)
            for r, state in requests.items()
        }
        tokens = {
            # A capped request gains nothing from drafts past its cap.
            r: _capped(_tokens_by_k(self._acceptance.position_rates(r), requested[r]), self._k_max)
            for r in request_ids
        }
        total = [sum(t[k] for t in tokens.values()) for k in range(self._k_max + 1)]
        # Drafts past a request's cap are not verified: the step is that much cheaper.
        unverified = [
            sum(k - min(k, cap) for cap in requested.values()) for k in range(self._k_max + 1)
        ]
        arrivals = self._arrivals_seconds(requests, tokens)
        steady = self._throughput(total, batch, unverified)
        throughput = self._throughput(total, batch, unverified, arrivals)
        best = max(range(1, self._k_max + 1), key=throughput.__getitem__)  # ties: fewer drafts
        expected = throughput[best] / throughput[0] * self.realised_fraction(batch)
        # What a step of it measures (no catch-up in it): what the realised fraction compares.
        speedup = steady[best] / steady[0]
        paying = expected >= 1.0 + self._min_gain
        if paying and self._needs_plain_steps(batch):
            # What speculation is measured against at this batch size: measure it now.
            return Decision(0, dict.fromkeys(request_ids, 0), "calibrating", 1.0, False)
        speedup_measured = self.end_to_end_speedup(batch)
        paying = paying and (speedup_measured is None or speedup_measured >= 1.0)
        if paying and _pays_back(catch_up, left, throughput[0], throughput[0] * expected):
            self._off_steps, self._off_seconds = 0, 0.0
            self._probe_interval = self._base_interval
            return Decision(best, self._caps(tokens, best, throughput[best]), None, speedup, False)
        self._off_steps += 1
        self._off_seconds += self._cost.predict(batch, 0)
        if batch in self._realised:
            self._realised[batch] += _REALISED_RECOVERY * (1.0 - self._realised[batch])
        if paying:
            reason = "too_short"
        elif batch > 1 and self._pays_alone(total, arrivals, batch):
            reason = "batch_too_large"
        else:
            reason = "not_paying"
        if self._probe_due(reason, requests, catch_up, left, throughput[0]):
            self._off_steps, self._off_seconds = 0, 0.0
            self._probe_interval = min(2 * self._probe_interval, self._max_interval)
            return Decision(best, dict.fromkeys(request_ids, best), None, speedup, True)
        return Decision(0, dict.fromkeys(request_ids, 0), reason, 1.0, False)

    def realised(self, predicted: float, measured: float, batch: int) -> None:
        """One steady speculating step of `batch` requests (the K it verified is the K it
        proposed, no prefill): the speedup the decision predicted for it
        (Decision.predicted_speedup) and the one it measured (tokens/s over the predicted
        no-speculation rate at its batch size)."""
        if predicted > 0.0:
            weight = min(_REALISED_WEIGHT * batch, _REALISED_MAX_WEIGHT)
            current = self._realised.get(batch, 1.0)
            self._realised[batch] = current + weight * (measured / predicted - current)

    def end_to_end(
        self, batch: int, seconds: float, tokens: int, prefill_tokens: int, speculating: bool
    ) -> None:
        """One step of `batch` requests that made `tokens` output tokens in `seconds`, with
        `prefill_tokens` prompt tokens in it: speculating (it proposed or verified drafts of a
        decision that chose K > 0) or plain (K = 0, nothing verified). Probes and the steps
        verifying them are neither."""
        if prefill_tokens:
            if not speculating:
                sample = (seconds - self._cost.predict(batch, 0)) / prefill_tokens
                known = self._prefill_seconds_per_token
                self._prefill_seconds_per_token = (
                    sample if known is None else known + _PREFILL_LEARNING * (sample - known)
                )
            if self._prefill_seconds_per_token is None:
                return
            seconds -= self._prefill_seconds_per_token * prefill_tokens
        speculating_side, plain_side = self._end_to_end.setdefault(batch, (_Side(), _Side()))
        if speculating:
            speculating_side.add(tokens, max(seconds, _MIN_STEP_SECONDS), _SPECULATING_DECAY)
            plain_side.fade(_PLAIN_STALENESS)
        else:
            plain_side.add(tokens, max(seconds, _MIN_STEP_SECONDS), _PLAIN_DECAY)
            speculating_side.fade(1.0 - _VETO_RECOVERY)

    def end_to_end_speedup(self, batch: int) -> float | None:
        """Measured tokens/s speculating over tokens/s not at this batch size (None: fewer
        than _VETO_MIN_STEPS steps of either yet)."""
        sides = self._end_to_end.get(batch)
        if sides is None or min(side.steps for side in sides) < _VETO_MIN_STEPS:
            return None
        speculating, plain = sides
        if not plain.tokens:
            return None
        return (speculating.tokens / speculating.seconds) / (plain.tokens / plain.seconds)

    @property
    def end_to_end_speedups(self) -> dict[int, float]:
        """The measured end-to-end speedup of every batch size with enough steps of both."""
        speedups = {batch: self.end_to_end_speedup(batch) for batch in sorted(self._end_to_end)}
        return {batch: speedup for batch, speedup in speedups.items() if speedup is not None}

    def _needs_plain_steps(self, batch: int) -> bool:
        """Speculation was measured at this batch size, too few plain steps to compare with."""
        sides = self._end_to_end.get(batch)
        if sides is None:
            return False
        speculating, plain = sides
        return speculating.steps >= _VETO_MIN_STEPS and plain.steps < _VETO_MIN_STEPS

    def realised_fraction(self, batch: int) -> float:
        """What predicted speedups at this batch size are scaled by: the realised fraction, at
        most 1 (a step realising more than predicted never makes speculation look better than
        the model); 1 where nothing was measured yet."""
        return min(self._realised.get(batch, 1.0), 1.0)

    @property
    def realised_fractions(self) -> dict[int, float]:
        """The realised fraction of every batch size measured so far."""
        return {batch: self.realised_fraction(batch) for batch in sorted(self._realised)}

    def _probe_due(
        self,
        reason: str,
        requests: Mapping[str, RequestState],
        catch_up: float,
        left: float,
        baseline: float,
    ) -> bool:
        if reason == "too_short":
            return False  # acceptance is known to pay; the tokens left are what is short
        if catch_up > _PROBE_CATCH_UP_BUDGET * self._off_seconds:
            return False
        if reason == "batch_too_large":
            # Acceptance is not in doubt (it would pay alone) and a probe at this batch is the
            # costliest kind (every request's draft catches up, every request verifies): only
            # the longest interval's, against a stale cost estimate.
            return self._off_steps >= self._max_interval
        # A probe refreshes acceptance: worth its catch-up only if the answer could change.
        return self._off_steps >= self._probe_interval and self._could_pay(
            requests, catch_up, left, baseline
        )

    def _throughput(
        self,
        total: list[float],
        batch: int,
        unverified: list[int] | None = None,
        arrivals: list[float] | None = None,
    ) -> list[float]:
        """Predicted output tokens/s at K = 0..k_max, given expected tokens per step at each,
        how many of the batch's K drafts each step leaves unverified (capped requests) and
        the catch-up on arriving requests' prompts each step brings (see _arrivals_seconds)."""
        verify = self._cost.verify_seconds_per_token()
        return [
            total[k]
            / max(
                self._cost.predict(batch, k)
                - verify * (unverified[k] if unverified else 0)
                + (arrivals[k] if arrivals else 0.0),
                _MIN_STEP_SECONDS,
            )
            for k in range(self._k_max + 1)
        ]

    def _arrivals_seconds(
        self, requests: Mapping[str, RequestState], tokens: Mapping[str, list[float]]
    ) -> list[float]:
        """Per step at K = 0..k_max, the draft's catch-up on the prompts of the requests that
        replace those finishing. In steady traffic a request is replaced when it ends, and one
        producing t tokens per step of a reply of n ends 1/(n/t) times per step; its successor,
        if the batch speculates, has the draft catch up on a prompt like its own. Paid once
        per request, it is what a request's own speedup must earn back: on a 2-core CPU the
        draft catches up ~0.0075 s per prompt token, and at eight code requests of 32 tokens a
        new one joins every few steps (that cell ran at 0.90x of K = 0 with each catch-up priced
        against the whole batch's savings, at 1.01x priced this way). Nothing at K = 0: the
        draft idles."""
        per_token = self._cost.catch_up_seconds(1)
        return [
            0.0
            if k == 0
            else per_token
            * sum(
                tokens[r][k] * state.prompt_tokens / min(max(state.max_tokens, 1), _HORIZON_TOKENS)
                for r, state in requests.items()
            )
            for k in range(self._k_max + 1)
        ]

    def _could_pay(
        self,
        requests: Mapping[str, RequestState],
        catch_up: float,
        left: float,
        baseline: float,
    ) -> bool:
        """Would speculation pay back this catch-up if every draft were accepted?"""
        batch = len(requests)
        perfect_tokens = [float(k + 1) for k in range(self._k_max + 1)]
        arrivals = self._arrivals_seconds(requests, dict.fromkeys(requests, perfect_tokens))
        perfect = self._throughput([batch * t for t in perfect_tokens], batch, arrivals=arrivals)
        return _pays_back(catch_up, left, baseline, max(perfect[1:]))

    def _calibrate(self, request_ids: list[str]) -> Decision:
        # Each K is held two steps so the second verifies what the first proposed (a steady-state
        # sample); the change between them varies V apart from P, which separates their costs.
        k = (self._calibration_steps // 2) % (self._k_max + 1)
        self._calibration_steps += 1
        return Decision(k, dict.fromkeys(request_ids, k), None if k else "calibrating", 1.0, True)

    def _pace_changed(self, batch: int) -> bool:
        """Whether a settled shape at this batch size (at any K: the one that runs is the one
        measured again) has been outside its band for its last _SHAPE_SAMPLES samples, since
        what was measured there was last forgotten (each shape's reference is its time when
        it first settled since)."""
        for k in range(self._k_max + 1):
            shape = (batch, k)
            now = self._cost.settled_seconds(shape)
            if now is None:
                continue
            then = self._pace.setdefault(shape, now)
            taken = self._cost.samples_taken(shape)
            outside_since = self._outside_since.get(shape)
            band = _DRAFTING_PACE_CHANGE if k else _PACE_CHANGE
            if 1.0 / band <= now / then <= band:
                self._outside_since.pop(shape, None)
            elif outside_since is None:
                self._outside_since[shape] = taken
            elif taken - outside_since >= _SHAPE_SAMPLES:
                return True
        return False

    def _forget_measurements(self, batch: int) -> None:
        """What was measured at this batch size described another machine: its shapes, its
        end-to-end sides and its realised fraction go, and probes start again from the
        shortest interval."""
        self._cost.forget_shapes(batch)
        self._end_to_end.pop(batch, None)
        self._realised.pop(batch, None)
        for k in range(self._k_max + 1):
            self._pace.pop((batch, k), None)
            self._outside_since.pop((batch, k), None)
        self._probe_interval = self._base_interval

    def _caps(self, tokens: dict[str, list[float]], k: int, throughput: float) -> dict[str, int]:
        # The draft runs K passes for everyone anyway; what a cap saves is verify time. One more
        # verified draft costs verify_seconds_per_token of the whole batch's time, i.e. that many
        # seconds of batch output; it yields the chance it is accepted (tokens[j] - tokens[j-1],
        # non-increasing in j, so the first draft that does not pay ends the cap; past a
        # request's own cap it yields nothing).
        price = self._cost.verify_seconds_per_token() * throughput
        caps = {}
        for request_id, t in tokens.items():
            cap = 0
            while cap < k and t[cap + 1] > t[cap] and t[cap + 1] - t[cap] >= price:
                cap += 1
            caps[request_id] = cap
        return caps

    def _pays_alone(self, total: list[float], arrivals: list[float], batch: int) -> bool:
        """Would the batch's mean request pay for speculation at batch size 1?"""
        alone = [
            total[k] / batch / (self._cost.predict(1, k) + arrivals[k] / batch)
            for k in range(self._k_max + 1)
        ]
        return max(alone[1:]) >= (1.0 + self._min_gain) * alone[0]
