"""The speculation autopilot's controller: how many draft tokens (K) to propose each engine step.

It rests on the cost model (cost_model.py: step time by shape, fitted on this machine) and the
acceptance tracker (acceptance.py: per-position acceptance of the live traffic). Controller picks
the K with the most expected output tokens per second, the draft's catch-up on arriving
requests' prompts included (0 when speculation does not pay, or when the requests end before the
draft's catch-up is paid back), per-request caps on verified drafts, the startup calibration
cycle, forgetting what a batch size measured when its steps change pace (a neighbour on the
cores came or went), and the probes that keep a stale "off" from lasting forever. Stdlib only:
the vLLM glue (server/vllm_plugins/autopilot_scheduler.py) feeds it measurements and applies
Decisions.
"""

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from server.autopilot.acceptance import AcceptanceTracker, capped_tokens, tokens_by_k
from server.autopilot.cost_model import MIN_STEP_SECONDS, SHAPE_SAMPLES, CostModel
from server.autopilot.end_to_end import CONFIDENT, EndToEnd
from server.autopilot.idle import IdleReason

# Weight of each request of a steady speculating step in the realised fraction of predicted
# speedups at its batch size (a step of one request: half-life ~14 steps; of eight, under 2 steps,
# since it measures eight requests' tokens at once; at most _REALISED_MAX_WEIGHT), and how fast
# the fraction returns to 1 while K stays 0 there (half-life ~350 steps), so one bad stretch does
# not keep speculation off for good. Recovery this slow against learning that fast bounds the
# retries: where steps realise 0.6 of the prediction, speculation runs in under 10% of steps.
_REALISED_WEIGHT = 0.05
_REALISED_MAX_WEIGHT = 0.5
_REALISED_RECOVERY = 0.002
# End to end at one batch size (end_to_end.py), prefill steps count on both sides less what the
# target's prefill costs (learnt from plain prefill steps), so that a side measured over more
# prefills does not read slower for it.
_PREFILL_LEARNING = 0.1  # weight of each plain prefill step in the target's prefill cost
# The machine's pace: where a settled step at a batch size (the low median of its shape's own
# full set of samples) stays this far from when it first settled, either way, for as many new
# samples as a full set, what was measured at that batch size describes another machine (a
# neighbour on the cores came or went): its shapes, its end-to-end sides and its realised
# fraction are forgotten and measured again as traffic runs, and probes restart from the
# shortest interval; otherwise what a neighbour slowed (the draft more than the target) keeps K
# too small for hundreds of steps after it left. A quiet machine moves as much, but not for as
# long, and steps with drafts vary more with the draft's work: they have a wider band.
_PACE_CHANGE = 1.1
_DRAFTING_PACE_CHANGE = 1.25
# A probe's catch-up is paid from this share of the time spent at K = 0 since the last probe
# (or since speculation stopped): the draft catches up on every request's whole context, which
# can cost several plain steps. Probes then cost at most this share of the time speculation is
# off, at the price of a later probe.
_PROBE_CATCH_UP_BUDGET = 0.02
# Steps whose batch sizes say whether requests have lately run together: a step of prefills
# only drafts if none of them had more requests than it (see Controller.choose).
_PREFILL_LOOKBACK_STEPS = 32
# Output tokens a request is expected to still produce, at most, when pricing the draft's
# catch-up against what speculation saves: a large max_tokens is a cap, not a promise (EOS).
_HORIZON_TOKENS = 256


def _pays_back(catch_up: float, tokens_left: float, baseline: float, faster: float) -> bool:
    """Does producing tokens_left at the faster rate instead of baseline (tokens/s) save more
    than catch_up seconds? (Nothing to catch up on always pays back.)"""
    if catch_up <= 0.0:
        return faster > baseline
    return tokens_left * (1.0 / baseline - 1.0 / faster) >= catch_up


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
    # Each request's cap on drafts it verifies next step (<= k); a request not named has k.
    per_request_k: dict[str, int] = field(default_factory=dict)
    reason: IdleReason | None = None  # why k is 0 (None when k > 0)
    predicted_speedup: float = 1.0  # predicted tokens/s at k over tokens/s at k=0 (1.0: unknown)
    probing: bool = False  # this k is a probe (or calibration), not the optimum


class Controller:
    """Each step, the K in 0..k_max with the most predicted output tokens per second.

    K > 0 only when it beats K = 0 by min_gain, a margin for the noise in the estimates (what
    steady predictions miss is measured and taken off before it: a larger margin would discount
    it twice). The predicted speedup is first scaled by the fraction of it that steady
    speculating steps at the same batch size have realised (see realised(), at most 1):
    choosing the requests whose acceptance estimate is high picks some that are high by chance,
    and the model's step times can be off. And only
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
        # Speculating against plain steps, see end_to_end().
        self._end_to_end = EndToEnd(CONFIDENT)
        self._prefill_seconds_per_token: float | None = None  # the target's, at K = 0
        self._recent_batches: deque[int] = deque(maxlen=_PREFILL_LOOKBACK_STEPS)

    def choose(self, requests: Mapping[str, RequestState]) -> Decision:
        """K for the next step of these requests (request id -> what the scheduler knows)."""
        request_ids = list(requests)
        if self._k_max == 0:
            return Decision(
                k=0, per_request_k=dict.fromkeys(request_ids, 0), reason=IdleReason.DISABLED
            )
        if not request_ids:
            return Decision(k=0, reason=IdleReason.NOT_PAYING)  # nothing to decode
        if not self._cost.ready:
            return self._calibrate(request_ids)
        batch = len(request_ids)
        lately = max(self._recent_batches, default=batch)
        self._recent_batches.append(batch)
        if lately > batch and all(state.prefilling for state in requests.values()):
            # Requests that arrive together reach the engine a few milliseconds apart: the
            # first is prefilled alone and the rest join it one step later. Drafted for at
            # the batch size of one, its drafts would be verified at the batch size of all. Where
            # requests have not run together lately, the prefill step drafts: idle there, the
            # draft catches up on the whole prompt in the next step, which then verifies
            # nothing. What each cost: docs/benchmarks.md, "Observations behind choices".
            return Decision(
                k=0, per_request_k=dict.fromkeys(request_ids, 0), reason=IdleReason.PREFILL
            )
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
            r: capped_tokens(
                tokens_by_k(self._acceptance.position_rates(r), requested[r]), self._k_max
            )
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
        if paying and self._end_to_end.needs_plain_steps(batch):
            # What speculation is measured against at this batch size: measure it now.
            return Decision(
                k=0, per_request_k=dict.fromkeys(request_ids, 0), reason=IdleReason.CALIBRATING
            )
        paying = paying and not self._end_to_end.slower(batch)
        if paying and _pays_back(catch_up, left, throughput[0], throughput[0] * expected):
            self._off_steps, self._off_seconds = 0, 0.0
            self._probe_interval = self._base_interval
            return Decision(
                k=best,
                per_request_k=self._caps(tokens, best, throughput[best]),
                predicted_speedup=speedup,
            )
        self._off_steps += 1
        self._off_seconds += self._cost.predict(batch, 0)
        if batch in self._realised:
            self._realised[batch] += _REALISED_RECOVERY * (1.0 - self._realised[batch])
        if paying:
            reason = IdleReason.TOO_SHORT
        elif batch > 1 and self._pays_alone(total, arrivals, batch):
            reason = IdleReason.BATCH_TOO_LARGE
        else:
            reason = IdleReason.NOT_PAYING
        if self._probe_due(reason, requests, catch_up, left, throughput[0]):
            self._off_steps, self._off_seconds = 0, 0.0
            self._probe_interval = min(2 * self._probe_interval, self._max_interval)
            return Decision(
                k=best,
                per_request_k=dict.fromkeys(request_ids, best),
                predicted_speedup=speedup,
                probing=True,
            )
        return Decision(k=0, per_request_k=dict.fromkeys(request_ids, 0), reason=reason)

    def served_by_lookups(self, batch: int) -> None:
        """A step whose lookups idled the draft (the scheduler decided it without asking): time
        at K = 0, toward the next probe's interval and catch-up budget. Where the draft stopped
        for a request whose lookups then serve it, its draft falls behind with every step; had
        those steps not counted, its probe's catch-up would outgrow the budget and the draft
        would not be tried again for the rest of the request."""
        self._off_steps += 1
        self._off_seconds += self._cost.predict(batch, 0)

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
        self._end_to_end.observe(batch, tokens, seconds, speculating)

    def end_to_end_speedup(self, batch: int) -> float | None:
        """Measured tokens/s speculating over tokens/s not at this batch size (None: fewer
        than four steps of either yet)."""
        return self._end_to_end.speedup(batch)

    @property
    def end_to_end_speedups(self) -> dict[int, float]:
        """The measured end-to-end speedup of every batch size with enough steps of both."""
        return self._end_to_end.speedups

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
        if reason is IdleReason.TOO_SHORT:
            return False  # acceptance is known to pay; the tokens left are what is short
        if catch_up > _PROBE_CATCH_UP_BUDGET * self._off_seconds:
            return False
        if reason is IdleReason.BATCH_TOO_LARGE:
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
                MIN_STEP_SECONDS,
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
        per request, it is what a request's own speedup must earn back (priced against the
        whole batch's savings instead, many short requests lost:
        docs/benchmarks.md, "Observations behind choices"). Nothing at K = 0: the draft idles."""
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
        return Decision(
            k=k,
            per_request_k=dict.fromkeys(request_ids, k),
            reason=None if k else IdleReason.CALIBRATING,
            probing=True,
        )

    def _pace_changed(self, batch: int) -> bool:
        """Whether a settled shape at this batch size (at any K: the one that runs is the one
        measured again) has been outside its band for its last SHAPE_SAMPLES samples, since
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
            elif taken - outside_since >= SHAPE_SAMPLES:
                return True
        return False

    def _forget_measurements(self, batch: int) -> None:
        """What was measured at this batch size described another machine: its shapes, its
        end-to-end sides and its realised fraction go, and probes start again from the
        shortest interval."""
        self._cost.forget_shapes(batch)
        self._end_to_end.forget(batch)
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
