"""The autopilot's cost model: this machine's engine step time as a linear function of the
step's shape, fitted online, and what the draft's catch-up over positions it missed costs.

Stdlib only; the controller (server/autopilot/policy.py) asks it what each K would cost.
"""

from collections import Counter, deque
from dataclasses import dataclass

MIN_STEP_SECONDS = 1e-6
# Steady steps kept per measured shape. Its time is their low median: step times are noisy
# upwards (a decode step right after a long prefill is much slower than usual:
# docs/benchmarks.md, "Observations behind choices"), so one slow step does not define a shape
# once a second sample exists.
SHAPE_SAMPLES = 5
# Pull toward the previous fit. Features are O(1)..O(B*K) and the window holds ~100 steps, so
# this is negligible wherever the window has data and only holds the directions it leaves open
# (a batch size or a K not seen lately) at their last estimate.
_RIDGE = 1e-3
# The long-run fit's memory: a step's weight halves every ~700 steps (minutes of traffic).
_LONG_FORGETTING = 0.999
# What the long-run fit weighs in the window's, per feature: as many steps as this, each with
# the largest value of the feature seen. In a window of K = 0 steps only the rare resumption
# prices the draft and its catch-up; without this, each one alone set those costs, which then
# swung several-fold within minutes (docs/benchmarks.md, "Observations behind choices").
_PRIOR_STEPS = 2.0


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
                        maxlen=SHAPE_SAMPLES,
                    )
                    for shape, samples in self._measured.items()
                }
        if step.verified_tokens == step.batch_size * step.proposed_k:
            shape = (step.batch_size, step.proposed_k)
            samples = self._measured.setdefault(shape, deque(maxlen=SHAPE_SAMPLES))
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
        bend (docs/benchmarks.md, "Observations behind choices"). What drafts cost is
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
        if len(samples) < SHAPE_SAMPLES:
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
        step in its window while two nearby sizes' slope is noise times the distance
        (docs/benchmarks.md, "Observations behind choices"); with nothing measured at this K, the
        fit.

        A step with drafts does all a plain step does and more, so K > 0 is never put below
        K = 0. A measured shape moves with its plain step since it was measured, and a plain
        step far off then (calibrated while the machine was busy: steps 3-4x their usual time)
        moves it by as much: on a 2-core CPU samples of K = 3 taken at 0.3 s against a plain
        step of 0.6 s would read below 0 s once the plain step is measured at its usual time.
        """
        seconds = self._shape_seconds(batch_size, k)
        if k > 0:
            seconds = max(seconds, self._shape_seconds(batch_size, 0))
        return max(seconds, MIN_STEP_SECONDS)

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
