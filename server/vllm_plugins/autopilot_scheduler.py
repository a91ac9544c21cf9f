"""vLLM's scheduler with the speculation autopilot deciding K every step (vLLM glue).

Loaded by vLLM's EngineCore process through `SchedulerConfig.scheduler_cls`.
After vLLM's own `schedule()` it sets `num_spec_tokens_to_schedule` (the K the
draft proposes at the end of the step) from a decision of
`server.autopilot.policy`, and caps each request's drafts when its own
acceptance does not pay for verifying them. It tracks up to which position
each request's draft has seen its tokens (the draft idles at K=0), and which KV
blocks hold the draft's KV (a prefix the prefix cache serves holds it only where
the draft computed it), so the policy can price the catch-up. After the step
it feeds the policy what it measured: the step's duration and shape (cost
model) and each request's accepted draft prefix (acceptance). Totals go to the front end
through `autopilot_report`, one bounded report per step: what it holds by batch size, only
for the `REPORT_BATCH_SIZES` batch sizes nearest the step's.

With the hybrid proposer (`--speculative-method hybrid`) lookups (scheduler_lookups.py) may
replace the draft's proposals before vLLM schedules the step; a step whose requests all verify
lookups priced with the draft idle or rest between runs of them idles it (reason "lookup"), the
draft catching up when it is needed again. Lookup steps stay out of what the controller measures
of the draft (its acceptance, its end-to-end comparison) and count as its time off toward a
probe; each request's steps with the draft idle for its lookups time its lookups' pace.

The mode comes from the engine's settings (`patching.settings()`): "auto"
(the controller), "fixed" (K up to a batch-size cut-off, as vLLM's static
table) and "script" (a forced K sequence, for the losslessness tests). In
every mode a request with `logit_bias` gets no drafts, its neighbours in the step keep theirs
(`logit_bias.py` says why that is safe), and a request's own `max_draft_tokens` (vLLM's
extra_args, `request_args.MAX_DRAFT_TOKENS_ARG`) caps its drafts: a step whose requests all
get none idles the draft. The policy itself is
pure and imports no vLLM. An exception in this glue turns speculation off for
the rest of the run (`patching.contained`), lookups included, instead of killing the engine
(a failure of the lookups alone turns only them off, scheduler_lookups.py). The patch's
declaration and this class's name are in autopilot_patch.py (this module imports vLLM as it
loads; the API process never imports it).
"""

import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, TextIO

from vllm.v1.core.sched.scheduler import Scheduler

from server.autopilot.acceptance import AcceptanceTracker, expected_tokens_per_step
from server.autopilot.cost_model import CostModel, StepRecord
from server.autopilot.end_to_end import ON_THE_MEAN, EndToEnd
from server.autopilot.idle import IdleReason
from server.autopilot.policy import Controller, Decision, RequestState
from server.autopilot.reports import SchedulerReport, Verified
from server.vllm_plugins import patching
from server.vllm_plugins.autopilot_patch import AUTOPILOT
from server.vllm_plugins.autopilot_report import Reporter
from server.vllm_plugins.give_way import give_way
from server.vllm_plugins.request_args import (
    CALIBRATION_PREFIX,
    LOOKUP_COUNTS_PARAM,
    draft_cap,
    has_logit_bias,
)
from server.vllm_plugins.scheduler_lookups import SchedulerLookups

logger = logging.getLogger(__name__)


def _contained(fallback: Any) -> Any:
    return patching.contained(AUTOPILOT, fallback)


# Batch sizes whose measurements a report carries: with K+1 step shapes per batch size, the
# report stays a few KiB whatever max_num_seqs lets the batch grow to.
REPORT_BATCH_SIZES = 16


def _near(batch: int, sizes: Iterable[int]) -> set[int]:
    """The REPORT_BATCH_SIZES of `sizes` nearest `batch` (the smaller of two as near)."""
    nearest = sorted(set(sizes), key=lambda size: (abs(size - batch), size))
    return set(nearest[:REPORT_BATCH_SIZES])


def _own_cap(request: Any) -> int | None:
    """The most drafts a request may verify per step by its own parameters: none with
    logit_bias (vLLM verifies drafts without the bias, logit_bias.py), else its own cap."""
    return 0 if has_logit_bias(request) else draft_cap(request)


def parse_script(text: str) -> list[int]:
    """`"0x2,3"` -> [0, 0, 3]: each K repeated as many steps as it says."""
    steps: list[int] = []
    for item in text.split(","):
        k, _, count = item.partition("x")
        steps.extend([int(k)] * int(count or 1))
    return steps


class AutopilotScheduler(Scheduler):
    """vLLM's scheduler; the per-step K and per-request draft caps differ, and a full batch
    gives way to a waiting request of smaller priority (give_way.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = patching.settings().get("autopilot", {})
        self._mode = settings.get("mode", "auto")
        self._max_batch = settings.get("max_batch_size")
        # The draft's largest K; vLLM's own (num_spec_tokens) is larger where lookups propose
        # more tokens than the draft.
        self._k_max = min(settings.get("draft_k_max", self.num_spec_tokens), self.num_spec_tokens)
        # "0x4,3x4,1": K for so many steps, cycled
        script = parse_script(settings.get("script") or "0")
        if max(script) > self._k_max:
            raise ValueError(f"speculation script goes past K={self._k_max}")
        self._script: Iterator[int] = itertools.cycle(script)
        # Calibration holds each K for two steps (the second verifies what the
        # first proposed), at each batch size the calibration requests make.
        self._calibration_cycle = [k for k in range(self._k_max + 1) for _ in (0, 1)]
        self._calibration_steps: Counter[int] = Counter()
        self._cost = CostModel()
        self._acceptance = AcceptanceTracker(self._k_max)
        self._controller = Controller(self._k_max, self._cost, self._acceptance)
        self._draft_verified = Verified()  # the draft's proposals the target verified
        # Where the engine enabled lookups (the hybrid, on CPU hosts: vllm_engine.py).
        lookup = settings.get("lookup")
        self._lookups = (
            SchedulerLookups(
                min(lookup["max_tokens"], self.num_spec_tokens),
                lookup["index_tokens"],
                self._cost if self._mode == "auto" else None,
                self._acceptance,
                EndToEnd(ON_THE_MEAN) if self._mode == "auto" else None,
            )
            if lookup is not None
            else None
        )
        self._decision: Decision | None = None
        # request id -> positions its draft has seen (mirrors draft_sync's catch-up)
        self._draft_seen: dict[str, int] = {}
        # KV blocks holding the draft's KV at every position of their tokens (mirrors
        # draft_sync's): what of a prefix the prefix cache serves the draft need not catch up on.
        self._draft_blocks: set[int] = set()
        self._caught_up = 0  # positions the draft catches up on in the step being run
        self._scheduled_at = 0.0
        self._steps_by_k: Counter[int] = Counter()
        self._zero_steps_by_reason: Counter[str] = Counter()
        self._measured_speedup: float | None = None
        self._verified_k = 0  # the K the step being run verifies (its predecessor's)
        self._verified_probe = False  # and whether that K was a probe's (or calibration's)
        self._idled_for_lookups = False  # the step before the one being run idled the draft
        self._reporter = Reporter("scheduler", patching.report_socket())
        # Without the draft_idle patch the draft runs every step: nothing to catch up on.
        self._draft_idles = patching.enabled("draft_idle")
        trace = settings.get("trace")  # one JSON line per step appended there
        # Line-buffered: a line per step reaches the file as the step ends.
        # Open for the engine core's life: it ends with the process.
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115
        logger.info(
            "specserve: speculation %s, K up to %d%s",
            self._mode,
            self._k_max,
            f", lookups up to {self._lookups.max_tokens} tokens" if self._lookups else "",
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._give_way()
        lookups = self._lookups_in_force()
        if lookups is not None:
            lookups.propose(self.running, self.structured_output_manager.validate_tokens)
        output = super().schedule(*args, **kwargs)
        if lookups is not None:
            self._lookups_scheduled(lookups, output)
        self._steer(output)
        return output

    @_contained(lambda self, lookups, output: None)
    def _lookups_scheduled(self, lookups: SchedulerLookups, output: Any) -> None:
        """What vLLM scheduled, to the lookups: their tokens it fit, the requests it prefills."""
        scheduled = output.num_scheduled_tokens
        lookups.scheduled(
            output.scheduled_spec_decode_tokens,
            [self.requests[r] for r, n in scheduled.items() if self._prefills(r, n)],
            len(scheduled),
        )

    @_contained(lambda self: None)
    def _give_way(self) -> None:
        """Preempt for fairness (give_way.py); a preempted request's draft starts over with
        it, as on its first step."""
        for request_id in give_way(self):
            self._draft_seen.pop(request_id, None)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        lookups = self._lookups_in_force()
        counts = lookups.finished(request, self.requests) if lookups is not None else None
        kv_transfer_params, ec_transfer_params = super()._free_request(request, *args, **kwargs)
        if counts is not None and kv_transfer_params is None:
            # Its request's lookups, to the response's counts by source (request_args.py); its
            # last step's are in them: _observe counts a step before vLLM's update frees it.
            kv_transfer_params = {LOOKUP_COUNTS_PARAM: counts}
        return kv_transfer_params, ec_transfer_params

    def _lookups_in_force(self) -> SchedulerLookups | None:
        """The lookups while the autopilot runs: its failure stops them with the drafts, one
        containment for everything this scheduler proposes (the autopilot's other paths that
        use them are contained already)."""
        return None if patching.failed(AUTOPILOT) else self._lookups

    def _speculation_off(self, output: Any) -> None:
        """The safe mode once the autopilot failed: no drafts for the rest of the run (a
        fixed K could hand drafts to a request with logit_bias, whose cap is this glue's)."""
        output.num_spec_tokens_to_schedule = 0
        self._decision = None

    @_contained(_speculation_off)
    def _steer(self, output: Any) -> None:
        """This step's K and per-request caps, into vLLM's scheduler output."""
        request_ids = list(output.num_scheduled_tokens)
        if not request_ids:
            return
        behind = self._draft_behind(output)
        caps = self._request_caps(request_ids)
        decision = self._with_request_caps(
            self._decide(output.num_scheduled_tokens, behind, caps), request_ids, caps
        )
        output.num_spec_tokens_to_schedule = decision.k
        self._caught_up = sum(behind.values()) if decision.k else 0
        self._decision = decision
        self._steps_by_k[decision.k] += 1
        if decision.k == 0 and decision.reason is not None:
            self._zero_steps_by_reason[decision.reason] += 1
        self._scheduled_at = time.perf_counter()

    def _request_caps(self, request_ids: list[str]) -> dict[str, int]:
        """The requests with a cap on drafts, and the cap: their own, or 0 with logit_bias."""
        return {r: c for r in request_ids if (c := _own_cap(self.requests[r])) is not None}

    def _draft_behind(self, output: Any) -> dict[str, int]:
        """Positions each scheduled request's draft would have to catch up on this step
        beyond a decode step's own (its new token and the drafts it verifies): what it missed
        while idle, and a prompt chunk scheduled now. vLLM has already advanced
        num_computed_tokens past this step's tokens. The blocks the target writes in this step
        leave the set of blocks holding the draft's KV."""
        behind: dict[str, int] = {}
        if not self._draft_idles:
            return dict.fromkeys(output.num_scheduled_tokens, 0)
        for request_id, scheduled in output.num_scheduled_tokens.items():
            drafts = len(output.scheduled_spec_decode_tokens.get(request_id, ()))
            computed = self.requests[request_id].num_computed_tokens
            own = 1 + drafts if scheduled >= 1 + drafts else scheduled
            start = computed - scheduled
            seen = self._draft_seen.get(request_id)
            if seen is None:
                # A request's first step: what came before it is the prefix the prefix cache
                # served, whose draft KV came with it over the blocks the draft wrote.
                seen = self._draft_seen[request_id] = self._draft_valid_prefix(request_id, start)
            # The target writes this step's positions: their blocks hold its KV alone now.
            self._draft_blocks.difference_update(
                self._block_ids(
                    request_id, start // self.block_size, (computed - 1) // self.block_size + 1
                )
            )
            behind[request_id] = max(0, computed - own - seen)
        return behind

    def _block_ids(self, request_id: str, first: int, end: int) -> list[int]:
        """The ids of the request's KV blocks first to end - 1 (its first KV cache group's,
        whose block table draft_sync writes the draft's KV through)."""
        blocks = self.kv_cache_manager.coordinator.get_blocks(request_id)[0]
        return [block.block_id for block in blocks[first:end]]

    def _draft_valid_prefix(self, request_id: str, cached: int) -> int:
        """Positions of a new request's cached prefix whose draft KV is there: its leading
        blocks that the draft wrote in full (draft_sync catches up on the rest)."""
        valid = 0
        for block in self._block_ids(request_id, 0, cached // self.block_size):
            if block not in self._draft_blocks:
                break
            valid += self.block_size
        return valid

    def _draft_saw(self, request_ids: Any) -> None:
        """After a step with K > 0: the draft has seen each request's tokens up to where vLLM
        now stands, rejected drafts already rolled back (as draft_sync's valid_until), and the
        blocks it wrote in full from where it stood before join the set holding its KV."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                written_from = self._draft_seen.get(request_id, 0)
                seen = self._draft_seen[request_id] = request.num_computed_tokens
                if self._draft_idles:
                    self._draft_blocks.update(
                        self._block_ids(
                            request_id, written_from // self.block_size, seen // self.block_size
                        )
                    )

    def _decide(
        self, scheduled: dict[str, int], behind: dict[str, int], caps: dict[str, int]
    ) -> Decision:
        """The step's decision; scheduled: the tokens each request computes in it."""
        request_ids = list(scheduled)
        if self._mode == "script":
            k = next(self._script)
            return Decision(k=k, reason=None if k else IdleReason.DISABLED)
        if self._mode == "auto" and all(r.startswith(CALIBRATION_PREFIX) for r in request_ids):
            # Measured steps at every K at each calibration batch size (not
            # only the first, which the policy alone would settle for), so
            # the cost of a batch is measured, not extrapolated from one request.
            batch = len(request_ids)
            step = self._calibration_steps[batch]
            self._calibration_steps[batch] += 1
            k = self._calibration_cycle[step % len(self._calibration_cycle)]
            return Decision(k=k, reason=None if k else IdleReason.CALIBRATING, probing=True)
        if self._lookups is not None and self._lookups.idles_draft(request_ids):
            # Every request verifies a lookup expected to continue next step, just ended a run
            # of them, or copies: no draft needed this step.
            if self._mode == "auto" and self._cost.ready:
                self._controller.served_by_lookups(len(request_ids))
            return Decision(k=0, reason=IdleReason.LOOKUP)
        if self._mode == "fixed":
            if self._max_batch is not None and len(request_ids) > self._max_batch:
                return Decision(k=0, reason=IdleReason.BATCH_TOO_LARGE)
            return Decision(k=self._k_max)
        return self._controller.choose(
            {r: self._state(r, scheduled[r], behind, caps) for r in request_ids}
        )

    def _state(
        self, request_id: str, scheduled: int, behind: dict[str, int], caps: dict[str, int]
    ) -> RequestState:
        request = self.requests[request_id]
        max_tokens = max(1, request.max_tokens or 1)
        return RequestState(
            behind=behind[request_id],
            tokens_left=max(1, max_tokens - request.num_output_tokens),
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=max_tokens,
            draft_cap=caps.get(request_id),
            prefilling=self._prefills(request_id, scheduled),
        )

    def _prefills(self, request_id: str, scheduled: int) -> bool:
        """Whether the request's `scheduled` tokens this step include some of its prompt."""
        request = self.requests[request_id]
        # vLLM has already advanced num_computed_tokens past this step's tokens.
        return bool(request.num_computed_tokens - scheduled < request.num_prompt_tokens)

    def _with_request_caps(
        self, decision: Decision, request_ids: list[str], caps: dict[str, int]
    ) -> Decision:
        """Each request's cap on top of the step's decision (in every mode; the controller
        also prices the caps). The step's K is the most any request may take, so a step whose
        requests all get none idles the draft (reason logit_bias where one of them is biased)."""
        if not caps or decision.k == 0:
            return decision
        per_request = dict(decision.per_request_k)
        for request_id, cap in caps.items():
            per_request[request_id] = min(cap, per_request.get(request_id, cap))
        k = min(decision.k, max(per_request.get(r, decision.k) for r in request_ids))
        if k == 0:
            biased = any(has_logit_bias(self.requests[r]) for r in request_ids)
            return Decision(
                k=0, reason=IdleReason.LOGIT_BIAS if biased else IdleReason.REQUESTED_OFF
            )
        return replace(decision, k=k, per_request_k=per_request)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        duration = time.perf_counter() - self._scheduled_at
        decision = self._decision
        step = self._observe(scheduler_output, model_runner_output, duration, decision)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._after_step(scheduler_output, decision, step)
        return outputs

    def _no_step(self, *args: Any) -> None:
        return None

    @_contained(_no_step)
    def _after_step(
        self, scheduler_output: Any, decision: Decision | None, step: StepRecord | None
    ) -> None:
        if decision is not None and decision.k:
            self._draft_saw(scheduler_output.num_scheduled_tokens)
        # Finished and aborted requests leave vLLM's table; every request with acceptance
        # state was scheduled, so it is in _draft_seen.
        for request_id in [r for r in self._draft_seen if r not in self.requests]:
            self._acceptance.forget(request_id)
            del self._draft_seen[request_id]
        if step is not None:
            self._report(decision, step.batch_size)

    @_contained(_no_step)
    def _observe(
        self,
        scheduler_output: Any,
        runner_output: Any,
        duration: float,
        decision: Decision | None,
    ) -> StepRecord | None:
        if decision is None or not scheduler_output.num_scheduled_tokens:
            return None
        spec = scheduler_output.scheduled_spec_decode_tokens
        sampled = runner_output.sampled_token_ids
        verified_total = prefill_tokens = generated = 0
        drafted = False  # the draft's proposals were verified in this step
        made: dict[str, int] = {}  # tokens by request
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            drafts = len(spec.get(request_id, ()))
            prefill_tokens += max(0, scheduled - 1 - drafts)
            index = runner_output.req_id_to_index.get(request_id)
            tokens = made[request_id] = len(sampled[index]) if sampled and index is not None else 0
            generated += tokens
            if drafts and tokens:
                verified_total += drafts
                if self._lookups is None or not self._lookups.observe(
                    request_id, drafts, tokens - 1
                ):
                    self._acceptance.observe(request_id, drafts, tokens - 1)
                    self._draft_verified.add(drafts, tokens - 1)
                    drafted = True
        step = StepRecord(
            duration=duration,
            batch_size=len(scheduler_output.num_scheduled_tokens),
            verified_tokens=verified_total,
            proposed_k=decision.k,
            prefill_tokens=prefill_tokens,
            caught_up_tokens=self._caught_up,
        )
        self._cost.observe(step)
        if self._lookups is not None:
            if prefill_tokens or decision.k or drafted:
                self._lookups.not_compared(step.batch_size)
            else:
                self._lookups.end_to_end(step.batch_size, duration, generated, verified_total > 0)
            idled = decision.reason is IdleReason.LOOKUP
            if (idled or self._idled_for_lookups) and not prefill_tokens:
                self._lookups.paced(duration, made)
        # What the controller measures is the draft's doing: neither a lookup step nor the
        # draft catching up after lookups idled it (the lookups' pricing pays for that).
        looked_up = self._lookups is not None and self._lookups.in_step()
        lookups_catch_up = self._idled_for_lookups and step.caught_up_tokens > 0
        if self._mode == "auto" and self._cost.ready and not (looked_up or lookups_catch_up):
            plain = decision.k == 0 and verified_total == 0
            probe_related = decision.probing or (verified_total > 0 and self._verified_probe)
            if plain or not probe_related:
                self._controller.end_to_end(
                    step.batch_size, duration, generated, prefill_tokens, speculating=not plain
                )
        if prefill_tokens == 0 and self._cost.ready and generated:
            # Realised tokens/s against the fitted no-speculation rate at this batch.
            baseline = step.batch_size / self._cost.predict(step.batch_size, 0)
            speedup = generated / duration / baseline
            previous = self._measured_speedup
            self._measured_speedup = speedup if previous is None else 0.9 * previous + 0.1 * speedup
            steady = decision.k > 0 and not decision.probing and decision.k == self._verified_k
            steady = steady and not looked_up
            if self._mode == "auto" and steady and not step.caught_up_tokens:
                self._controller.realised(decision.predicted_speedup, speedup, step.batch_size)
        self._verified_k = decision.k  # what the next step verifies
        self._verified_probe = decision.probing
        self._idled_for_lookups = decision.reason is IdleReason.LOOKUP
        if self._trace is not None:
            self._write_trace(self._trace, step, generated, decision)
        return step

    def _write_trace(
        self, trace: TextIO, step: StepRecord, generated: int, decision: Decision
    ) -> None:
        """The step, the decision it ran under and what the controller knew then."""
        ready = self._cost.ready
        line = {
            "time": time.time(),
            "seconds": step.duration,
            "batch": step.batch_size,
            "verified": step.verified_tokens,
            "prefill_tokens": step.prefill_tokens,
            "caught_up": step.caught_up_tokens,
            "generated": generated,
            "k": decision.k,
            "caps": sorted(decision.per_request_k.values()),
            "reason": decision.reason,
            "probing": decision.probing,
            "predicted_speedup": decision.predicted_speedup,
            "lookups": self._lookups.in_step() if self._lookups is not None else 0,
            "predicted_seconds_by_k": [
                self._cost.predict(step.batch_size, k) for k in range(self._k_max + 1)
            ]
            if ready
            else None,
            "acceptance_by_position": self._acceptance.position_rates(),
            "end_to_end_speedup": self._controller.end_to_end_speedup(step.batch_size),
            "realised_fraction": self._controller.realised_fraction(step.batch_size),
        }
        trace.write(json.dumps(line) + "\n")

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        super().update_draft_token_ids(draft_token_ids)
        self._cap_drafts(draft_token_ids)

    def _drop_drafts(self, draft_token_ids: Any) -> None:
        """Where capping failed: no request keeps a draft (one could be biased)."""
        for request_id in draft_token_ids.req_ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.spec_token_ids = []

    @_contained(_drop_drafts)
    def _cap_drafts(self, draft_token_ids: Any) -> None:
        """Each request's drafts cut to its cap; a biased request's to none, whatever the step
        decided (what keeps drafts away from it, logit_bias.py)."""
        caps = self._decision.per_request_k if self._decision is not None else {}
        for request_id in draft_token_ids.req_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            cap = 0 if has_logit_bias(request) else caps.get(request_id)
            if cap is not None and len(request.spec_token_ids) > cap:
                request.spec_token_ids = request.spec_token_ids[:cap]

    def _report(self, decision: Decision | None, batch: int) -> None:
        rates = self._acceptance.position_rates()
        end_to_end = self._controller.end_to_end_speedups
        realised = self._controller.realised_fractions
        spread = self._cost.spread()  # by "BxK"
        shown = _near(batch, [*end_to_end, *realised, *(int(s.split("x")[0]) for s in spread)])
        report: SchedulerReport = {
            "mode": self._mode,
            "k": decision.k if decision else 0,
            "reason": decision.reason if decision else None,
            "probing": decision.probing if decision else False,
            "predicted_speedup": decision.predicted_speedup if decision else 1.0,
            "measured_speedup": self._measured_speedup,
            "end_to_end_speedup_by_batch": {
                str(size): speedup for size, speedup in end_to_end.items() if size in shown
            },
            "realised_fraction_by_batch": {
                str(size): fraction for size, fraction in realised.items() if size in shown
            },
            "steps_by_k": {str(k): n for k, n in self._steps_by_k.items()},
            "zero_steps_by_reason": dict(self._zero_steps_by_reason),
            "acceptance_by_position": rates,
            "expected_tokens_per_step": expected_tokens_per_step(rates, len(rates)),
            "cost_ready": self._cost.ready,
            "draft_seconds_per_token": self._cost.draft_seconds_per_token(1)
            if self._cost.ready
            else None,
            "verify_seconds_per_token": self._cost.verify_seconds_per_token()
            if self._cost.ready
            else None,
            # What one plain target step costs a lone request: the draft's price per
            # position reads as a fraction of it.
            "plain_step_seconds": self._cost.predict(1, 0) if self._cost.ready else None,
            "step_spread_by_shape": {
                shape: value for shape, value in spread.items() if int(shape.split("x")[0]) in shown
            },
            "verified_by_source": {"draft": self._draft_verified.as_dict()},
        }
        if self._lookups is not None:
            self._lookups.add_to(report)
        self._reporter.send(report)
