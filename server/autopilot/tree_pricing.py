"""What a suffix tree's proposal (suffix_tree.py) is worth verifying: each position's chance of
acceptance, as the hybrid's scheduler (server/vllm_plugins/scheduler_lookups.py) prices it
against the draft's proposal and against one more verified token's cost.

The tree says how often each continuation followed before (`Proposal.probs`); position i's
estimate, given the positions before it accepted, is probs[i] / probs[i - 1]. That knows the
text, not the target: a token that followed once reads 1.0 after a one-token match as after a
twenty-token copy, and the model may word the same code otherwise. So estimates are calibrated
by what the target accepted, counted (recency weighted) per key: origin (the request's own
context or its tenant's replies), match class (position i extends a match of match_length + i
tokens: 1-2, 3-7, 8 and more) and estimate bucket (under 0.5, 0.5-0.9, 0.9 and more). A
position's rate is its key's counts blended with PRIOR_STRENGTH observations of the tree's own
estimate: unmeasured, a proposal is priced as the tree says; once its key has been verified a
few dozen times, as the target accepted.

Why these keys: by origin and estimate alone, a one-token coincidence seen once would be priced
like a copy in progress (both read 1.0, and a copy's eight positions a step would set the
rate); one learnt factor scaling every estimate would do the same. 2 x 3 x 3 keys stay few
enough that each is measured within the first requests that reach it.

A step of lookups that idles the draft leaves a request's next step without a draft proposal:
where its run of lookups ends there, that step verifies nothing while the draft catches up.
How often a run ends after a step is measured too, by origin and match class: on chat most
runs are one short match long, on code edits a copy runs for many steps.

Stdlib only.
"""

from bisect import bisect_right

from server.autopilot.acceptance import tokens_by_k
from server.autopilot.suffix_tree import Proposal

# The shortest match of each class, the lowest estimate of each bucket past the first.
MATCH_CLASSES = (1, 3, 8)
ESTIMATE_EDGES = (0.5, 0.9)
# Positions of one key; a key's acceptance follows a change of traffic within a few requests.
HALF_LIFE_POSITIONS = 64.0
# Observations the tree's own estimate counts as, in positions: a key's first misses move its
# price, one miss does not undo a tree's certainty.
PRIOR_STRENGTH = 4.0

Key = tuple[str, int, int]  # origin, match class, estimate bucket
RunKey = tuple[str, int]  # origin, match class
# Before a run's end is measured, a step is priced as even odds of being its last.
RUN_END_PRIOR = 0.5


def _estimates(proposal: Proposal) -> list[float]:
    """The tree's estimate of each position's acceptance, the positions before it accepted."""
    conditional: list[float] = []
    before = 1.0
    for prob in proposal.probs:
        conditional.append(prob / before)
        before = prob
    return conditional


def _match_class(match_length: int) -> int:
    return bisect_right(MATCH_CLASSES, match_length) - 1


def _run_key(proposal: Proposal) -> RunKey:
    return proposal.origin, _match_class(proposal.match_length)


def _keys(proposal: Proposal) -> list[tuple[Key, float]]:
    """Each position's key and the tree's estimate of it."""
    return [
        (
            (
                proposal.origin,
                _match_class(proposal.match_length + i),
                bisect_right(ESTIMATE_EDGES, estimate),
            ),
            estimate,
        )
        for i, estimate in enumerate(_estimates(proposal))
    ]


class TreePricing:
    """Acceptance of tree proposals by origin, match class and estimate bucket, as measured."""

    def __init__(self) -> None:
        self._decay = 0.5 ** (1.0 / HALF_LIFE_POSITIONS)
        self._counts: dict[Key, tuple[float, float]] = {}  # reached, accepted (decayed)
        self._runs: dict[RunKey, tuple[float, float]] = {}  # steps, last of their run (decayed)

    def rates(self, proposal: Proposal) -> list[float]:
        """Each position's calibrated chance of acceptance, the positions before it accepted."""
        rates: list[float] = []
        for key, estimate in _keys(proposal):
            reached, accepted = self._counts.get(key, (0.0, 0.0))
            rates.append((accepted + PRIOR_STRENGTH * estimate) / (reached + PRIOR_STRENGTH))
        return rates

    def expected_tokens(self, proposal: Proposal, length: int) -> float:
        """Tokens a verify step of the proposal's first `length` tokens is expected to give
        (bonus included)."""
        return tokens_by_k(self.rates(proposal), length)[length]

    def worth_verifying(self, proposal: Proposal, price: float) -> int:
        """How many of the proposal's tokens to verify: each while the chance that it and all
        before it are accepted is at least `price` (one verified token's cost in output
        tokens)."""
        length, reach = 0, 1.0
        for rate in self.rates(proposal):
            reach *= rate
            if reach < price:
                break
            length += 1
        return length

    def observe(self, proposal: Proposal, verified: int, accepted: int) -> None:
        """One verify step of the proposal's first `verified` tokens: the first `accepted`
        passed."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"need 0 <= accepted <= verified, got {accepted}, {verified}")
        for position, (key, _) in enumerate(_keys(proposal)[: min(verified, accepted + 1)]):
            reached, passed = self._counts.get(key, (0.0, 0.0))
            self._counts[key] = (
                self._decay * reached + 1.0,
                self._decay * passed + float(position < accepted),
            )

    def run_ends(self, proposal: Proposal) -> float:
        """The chance that a request verifying the proposal with the draft idle finds no
        lookup worth verifying at its next step."""
        steps, ended = self._runs.get(_run_key(proposal), (0.0, 0.0))
        return (ended + PRIOR_STRENGTH * RUN_END_PRIOR) / (steps + PRIOR_STRENGTH)

    def observe_run(self, proposal: Proposal, ended: bool) -> None:
        """A request verified the proposal with the draft idle; its next step `ended` the
        run (verified no lookup)."""
        key = _run_key(proposal)
        steps, last = self._runs.get(key, (0.0, 0.0))
        self._runs[key] = (self._decay * steps + 1.0, self._decay * last + float(ended))
