"""The hybrid proposer's side of the autopilot's scheduler (vLLM glue, EngineCore process).

Before vLLM schedules a step, each decoding request's continuation is looked up in the suffix
trees of its own context and of its tenant's earlier replies (`server.autopilot.suffix_tree`),
priced by the trees' frequencies calibrated against what the target accepted
(`server.autopilot.tree_pricing`). A lookup replaces the draft's proposal for that request
(`Request.spec_token_ids`, what vLLM schedules) where it is expected to make the request's
tokens faster, cut to the tokens worth verifying at this machine's verify cost. A match of any
length may propose, one token of agreement included: after an edit, lookups resume where what
followed the last tokens before was frequent. Where every request of a step has a lookup that
wins against the draft with the draft idle (its passes saved, the end of its run paid for),
the scheduler idles the draft; otherwise the draft runs for the step anyway, and a lookup
replaces a request's draft proposal only where it is expected to give more tokens in that step.
A request copies (code edits: its reply is mostly its prompt) where the steps its lookups ran
with the draft idle, the plain steps between its runs and the draft's restart after them
included, made its tokens faster than its draft's steps would: it is then proposed up to
COPY_SPEC_FACTOR times its match, and its draft stays idle between its runs of lookups, where
restarting it would cost a step that verifies nothing each time a run ends. A wait is a ski
rental: plain steps go on until what they lost against the draft's pace reaches what a restart
costs (its step makes one token), then the draft restarts. The measure goes on while it copies,
so a request that stops copying gets its draft back. Until its own steps can tell, a request
copies where its tenant's latest finished request did, from its prefill on (which then idles the
draft: a copy's first decode steps verify lookups, so the draft's proposal would go unverified).
The scheduler keeps lookup steps out of what its controller measures of the draft, and feeds
each finished reply into its tenant's tree. In auto mode lookups also
answer to what they measured: they are priced at this machine's step and verify costs, and at
a batch size where steps verifying lookups made fewer tokens per second than plain steps, none
are proposed until that evidence fades (end_to_end.py). Fixed mode decides nothing from
timings, as its K does not: a lookup there is verified whole where the trees expect more tokens
of it than of the draft's proposal.
Calibration requests, requests with logit_bias, requests that capped their drafts at 0 and
requests that asked for none (`speculation.lookups: false`) get no lookups. An exception here
turns lookups off for the rest of the process (`patching.contained`); the draft goes on alone.
A failure of the autopilot turns them off too (the scheduler stops calling them): nothing is
proposed past it. `LOOKUP` declares the patch for the registry.
"""

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from server.autopilot.acceptance import AcceptanceTracker, tokens_by_k
from server.autopilot.cost_model import CostModel
from server.autopilot.end_to_end import EndToEnd
from server.autopilot.reports import SchedulerReport, Verified, VerifiedCounts
from server.autopilot.suffix_tree import Proposal, SuffixProposer
from server.autopilot.tree_pricing import TreePricing
from server.vllm_plugins import patching
from server.vllm_plugins.request_args import (
    CALIBRATION_PREFIX,
    NO_LOOKUPS_ARG,
    REQUEST_ARG,
    TENANT_ARG,
    draft_cap,
    extra_arg,
    has_logit_bias,
)
from server.vllm_plugins.vllm_source import Hook

LOOKUP = patching.Patch(
    "lookup",
    "proposals looked up in the prompt and in the tenant's earlier replies (the hybrid; "
    "otherwise the draft model alone)",
    (
        Hook(
            "vllm.v1.core.sched.scheduler",
            "Scheduler",
            members=("running", "requests", "structured_output_manager", "_free_request"),
        ),
        Hook(
            "vllm.v1.structured_output",
            "StructuredOutputManager.validate_tokens",
            ("request", "spec_tokens"),
        ),
        Hook(
            "vllm.v1.request",
            "Request",
            members=(
                "all_token_ids",
                "output_token_ids",
                "is_prefill_chunk",
                "num_tokens",
                "is_finished",
            ),
        ),
    ),
    needs=("autopilot",),
    speculation_only=True,
    only_when_asked=True,
)


# A copying request's lookups propose up to this many times their match (the paper's
# max_spec_factor; 1 otherwise): a copy's short match after an edit is followed by a long one.
COPY_SPEC_FACTOR = 4.0
# Steps of a request's lookups with the draft idle before they can tell it copies.
COPY_MIN_STEPS = 4
# Its pace follows the latest steps: a request that stops copying gets its draft back soon.
COPY_HALF_LIFE_STEPS = 8.0


@dataclass
class _LookupPace:
    """One request's tokens and seconds in the steps its lookups ran with the draft idle (the
    plain steps between its runs, and the draft's restart after them, included), recency
    weighted."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        decay = 0.5 ** (1.0 / COPY_HALF_LIFE_STEPS)
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1


def _none(*args: Any) -> dict[str, Proposal]:
    return {}


def _nothing(*args: Any) -> None:
    return None


class SchedulerLookups:
    """Lookups for one engine's scheduler: what it proposes, what was verified, the counts."""

    def __init__(
        self,
        max_tokens: int,
        index_tokens: int,
        cost: CostModel | None,
        acceptance: AcceptanceTracker,
        veto: EndToEnd | None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens  # the most tokens of a lookup verified in one step
        self._proposer = SuffixProposer(index_tokens)
        self._pricing = TreePricing()
        self._veto = veto  # auto mode: no lookups at a batch size where they measured slower
        self._cost = cost  # auto mode: the step and verify costs (None: fixed mode, no timings)
        self._acceptance = acceptance  # the draft's, which a lookup is weighed against
        self._proposed: dict[str, Proposal] = {}  # this step's lookups, before vLLM schedules
        self._step: dict[str, Proposal] = {}  # request id -> the lookup it verifies this step
        self._idles_draft = False  # this step's requests all go without the draft
        # Requests that go without the draft this step although they verify no lookup: their
        # run of lookups just ended, or they copy.
        self._resting: set[str] = set()
        self._paces: dict[str, _LookupPace] = {}  # each running sequence's lookups' pace
        self._waited: dict[str, int] = {}  # plain steps a copying request has rested in a row
        # Each running sequence offered lookups: whether its own pace said it copies (False
        # until it tells); and each tenant's latest finished one's, which its next starts with.
        self._copied: dict[str, bool] = {}
        self._tenant_copied: dict[str | None, bool] = {}
        self._by_origin = {"prompt": Verified(), "replies": Verified()}
        self._by_request: dict[str, Verified] = {}  # each running sequence's lookups
        # Front-end request id -> its finished sequences' counts, while a sibling runs.
        self._finished: dict[str, dict[str, VerifiedCounts]] = {}
        self._seconds = 0.0  # spent finding lookups
        self._rounds = 0  # steps that looked up

    @patching.contained(LOOKUP, _none)
    def propose(
        self, running: Iterable[Any], validate: Callable[[Any, list[int]], list[int]]
    ) -> dict[str, Proposal]:
        """Each decoding request's lookup, where it beats the draft's proposal, into its
        spec_token_ids (`validate`: vLLM's grammar check of proposed tokens)."""
        started = time.perf_counter()
        requests = list(running)
        batch = len(requests)
        price = self._verify_price(batch)
        previous = self._step  # what the last step verified of lookups, by request
        rested = self._resting  # and which requests rested in it
        # Each lookup, its length, and whether it wins with the draft idle and beside it.
        candidates: list[tuple[Any, Proposal, int, bool, bool]] = []
        resting: set[str] = set()
        if self._veto is not None and self._veto.slower(batch):
            requests = []
        for request in requests:
            request_id = request.request_id
            cap = self._cap(request)
            if (
                request.is_prefill_chunk
                or request.num_computed_tokens != request.num_tokens - 1
                or cap == 0
            ):
                continue
            tenant = extra_arg(request, TENANT_ARG)
            copying = self._copies(request, batch)
            factor = COPY_SPEC_FACTOR if copying else None
            proposal = self._proposer.find(request_id, tenant, request.all_token_ids, cap, factor)
            length = 0 if proposal is None else self._pricing.worth_verifying(proposal, price)
            before = previous.get(request_id)
            if before is not None and not request.spec_token_ids:  # the draft idled
                self._pricing.observe_run(before, ended=length == 0)
                if length == 0:
                    resting.add(request_id)  # one plain step: lookups often resume then
            if proposal is None or length == 0:
                if copying and self._waits(request_id, batch):
                    resting.add(request_id)
                continue
            # Its draft idled for its lookups last step: without a lookup now it restarts.
            restarts = (before is not None or request_id in rested) and not request.spec_token_ids
            idle, beside = self._wins(request, proposal, length, batch, restarts)
            candidates.append((request, proposal, length, idle or copying, beside))
        # The draft idles only where every request goes without it; else it runs anyway.
        idles = len(candidates) + len(resting) == batch and all(idle for *_, idle, _ in candidates)
        chosen: dict[str, Proposal] = {}
        for request, proposal, length, idle, beside in candidates:
            if idle if idles else beside:
                tokens = validate(request, proposal.tokens[:length])
                if tokens:
                    request.spec_token_ids = tokens
                    chosen[request.request_id] = proposal
        self._seconds += time.perf_counter() - started
        self._rounds += 1
        self._proposed = chosen
        self._idles_draft = idles
        self._resting = resting
        self._waited = {r: self._waited.get(r, 0) + 1 for r in resting}
        return chosen

    def _none_scheduled(self, *args: Any) -> None:
        """Once lookups failed: no step verifies one or idles the draft for them."""
        self._step, self._proposed, self._idles_draft = {}, {}, False

    @patching.contained(LOOKUP, _none_scheduled)
    def scheduled(
        self, spec_decode_tokens: Mapping[str, list[int]], prefilling: Iterable[Any], batch: int
    ) -> None:
        """What vLLM scheduled of this step's lookups (a request it could not fit has none),
        and the requests it prefills in this step of `batch`: one expected to copy rests, its
        draft idle from its prompt on (a proposal would go unverified: a copy's first decode
        steps verify lookups)."""
        self._step = {r: p for r, p in self._proposed.items() if spec_decode_tokens.get(r)}
        self._proposed = {}
        for request in prefilling:
            if self._cap(request) and self._copies(request, batch):
                self._resting.add(request.request_id)

    def in_step(self) -> int:
        """Requests verifying a lookup in this step."""
        return len(self._step)

    def idles_draft(self, request_ids: list[str]) -> bool:
        """Whether the draft idles this step: every request of it verifies a lookup priced with
        the draft idle, or rests. A request rests for one plain step where its run of lookups
        with the draft idle just ended (restarting the draft costs a step that only proposes,
        nothing of the draft's being there to verify, and after an edit the lookups often
        resume one token later), and for as long as it copies."""
        return (
            self._idles_draft
            and bool(request_ids)
            and all(r in self._step or r in self._resting for r in request_ids)
        )

    def paced(self, seconds: float, tokens: Mapping[str, int]) -> None:
        """A decode step that idled the draft for lookups or follows one that did (the draft's
        restart): each request's tokens in it, to its lookups' pace."""
        for request_id, made in tokens.items():
            self._paces.setdefault(request_id, _LookupPace()).add(made, seconds)

    def observe(self, request_id: str, verified: int, accepted: int) -> bool:
        """A verify step of one request; False where its proposal was the draft's."""
        proposal = self._step.get(request_id)
        if proposal is None:
            return False
        self._pricing.observe(proposal, verified, accepted)
        self._by_origin[proposal.origin].add(verified, accepted)
        self._by_request.setdefault(request_id, Verified()).add(verified, accepted)
        return True

    def end_to_end(self, batch: int, seconds: float, tokens: int, looked_up: bool) -> None:
        """A decode step without draft work: it verified lookups, or nothing at all."""
        if self._veto is not None:
            self._veto.observe(batch, tokens, seconds, trying=looked_up)

    def not_compared(self, batch: int) -> None:
        """A step with draft work or a prefill, which the veto does not compare: where
        lookups stopped, such steps count toward their retry as plain ones do."""
        if self._veto is not None:
            self._veto.neither(batch)

    @patching.contained(LOOKUP, _nothing)
    def finished(
        self, request: Any, requests: Mapping[str, Any]
    ) -> dict[str, VerifiedCounts] | None:
        """A sequence left the engine (`requests`: vLLM's, it still among them): its tree
        goes, its reply joins its tenant's tree (calibration's requests have no tenant). What
        its last output carries to the front end: the lookup counts of its request's finished
        sequences, its own included, by sequence id (None: none looked up)."""
        request_id = request.request_id
        tenant = extra_arg(request, TENANT_ARG)
        self._proposer.finish(request_id, tenant, request.output_token_ids)
        copied = self._copied.pop(request_id, None)
        if copied is not None:
            self._tenant_copied[tenant] = copied
        self._paces.pop(request_id, None)
        self._waited.pop(request_id, None)
        own = self._by_request.pop(request_id, None)
        key = extra_arg(request, REQUEST_ARG)
        if key is None:
            return None
        finished = self._finished.setdefault(key, {})
        if own is not None:
            finished[request_id] = own.as_dict()
        if not any(
            extra_arg(r, REQUEST_ARG) == key and not r.is_finished() for r in requests.values()
        ):
            del self._finished[key]  # its last sequence
        return finished or None

    def _cap(self, request: Any) -> int:
        """The most looked-up tokens the request may verify in a step: 0 for calibration
        requests, requests with logit_bias, requests that asked for no lookups or capped their
        drafts at 0."""
        if (
            request.request_id.startswith(CALIBRATION_PREFIX)
            or has_logit_bias(request)
            or extra_arg(request, NO_LOOKUPS_ARG)
        ):
            return 0
        own_cap = draft_cap(request)
        return self.max_tokens if own_cap is None else max(0, min(own_cap, self.max_tokens))

    def _copies(self, request: Any, batch: int) -> bool:
        """Whether the request's lookups, with the draft idle, made its tokens faster than its
        draft's steps would (auto mode: fixed mode has no timings). Until they have run long
        enough to tell, a request copies where its tenant's latest request did: an editor's
        requests are code edits one after the other. The request's own verdict is kept for its
        tenant's next request (`finished`)."""
        cost = self._cost
        if cost is None or not cost.ready:
            return False
        request_id = request.request_id
        pace = self._paces.get(request_id)
        if pace is None or pace.steps < COPY_MIN_STEPS:
            self._copied.setdefault(request_id, False)
            return self._tenant_copied.get(extra_arg(request, TENANT_ARG), False)
        _, draft_seconds_per_token = self._draft_pace(cost, request_id, batch)
        copies = self._copied[request_id] = pace.seconds < draft_seconds_per_token * pace.tokens
        return copies

    def _waits(self, request_id: str, batch: int) -> bool:
        """Whether a copying request without a lookup rests one more plain step rather than
        restart its draft: while the plain steps it rested in a row lost less against the
        draft's pace than a restart costs over it (the restart's step makes one token)."""
        cost = self._cost
        assert cost is not None  # a copying request was priced
        plain = cost.predict(batch, 0)
        draft_step, draft_seconds_per_token = self._draft_pace(cost, request_id, batch)
        lost = self._waited.get(request_id, 0) * (plain - draft_seconds_per_token)
        return lost < draft_step - draft_seconds_per_token

    def _draft_pace(self, cost: CostModel, request_id: str, batch: int) -> tuple[float, float]:
        """A step of the request's draft at the K that makes its tokens fastest: the step's
        seconds and its seconds per expected token."""
        rates = self._acceptance.position_rates(request_id)
        tokens = tokens_by_k(rates, len(rates))
        return min(
            (
                (cost.predict(batch, k), cost.predict(batch, k) / tokens[k])
                for k in range(1, len(tokens))
            ),
            key=lambda priced: priced[1],
        )

    def _wins(
        self, request: Any, proposal: Proposal, length: int, batch: int, restarts: bool
    ) -> tuple[bool, bool]:
        """Whether verifying the lookup's first `length` tokens instead of the draft's proposal
        (none where the draft idled) is expected to make the request's tokens faster: in a step
        of lookups alone, and in a step that runs the draft anyway.

        Alone, the step runs no draft pass, but where the draft has a proposal the lookup is
        charged what the next step loses when its run ends there: the draft's proposal, all but
        the one token a step makes without it, while the draft catches up. Where the draft
        idled for the request's lookups (`restarts`), a lookup alone must beat the draft's own
        pace, not a plain step's: it puts the draft's restart off without saving it. Beside
        the draft (for the other requests), the step is the same but for the tokens
        verified."""
        drafts = len(request.spec_token_ids)
        draft_tokens = tokens_by_k(self._acceptance.position_rates(request.request_id), drafts)[-1]
        lookup_tokens = self._pricing.expected_tokens(proposal, length)
        run_end = self._pricing.run_ends(proposal) * (draft_tokens - 1.0) if drafts else 0.0
        cost = self._cost
        if cost is None or not cost.ready:
            return lookup_tokens - run_end > draft_tokens, lookup_tokens > draft_tokens
        step = cost.predict(batch, drafts)
        verify = cost.verify_seconds_per_token()
        alone = (lookup_tokens - run_end) / (cost.predict(batch, 0) + verify * length)
        beside = lookup_tokens / (step + verify * (length - drafts))
        pace = draft_tokens / step
        if restarts:
            pace = max(pace, 1.0 / self._draft_pace(cost, request.request_id, batch)[1])
        return alone > pace, beside > draft_tokens / step

    def _verify_price(self, batch: int) -> float:
        """One more verified token's cost, in the output tokens a plain step of this batch
        makes in that time (0 in fixed mode and until the cost model is ready: verify what is
        found)."""
        cost = self._cost
        if cost is None or not cost.ready or batch == 0:
            return 0.0
        return cost.verify_seconds_per_token() * batch / cost.predict(batch, 0)

    def add_to(self, report: SchedulerReport) -> None:
        """The lookups' counts into the scheduler's report: all origins together as the
        `lookup` source, each origin, their cost per step and the reply trees' size."""
        origins = self._by_origin.values()
        report["verified_by_source"]["lookup"] = {
            "verified": sum(c.verified for c in origins),
            "accepted": sum(c.accepted for c in origins),
            "steps": sum(c.steps for c in origins),
        }
        report["lookup_by_origin"] = {o: c.as_dict() for o, c in self._by_origin.items()}
        report["lookup_seconds_per_step"] = self._seconds / max(self._rounds, 1)
        report["lookup_index_tokens"] = self._proposer.replies.tokens
        report["lookup_index_replies"] = self._proposer.replies.replies
