"""The autopilot's view of draft acceptance: per-position rates of the live traffic, overall and
per request, and the expected output tokens per step they give each K.

Stdlib only; the controller (server/autopilot/policy.py) reads it.
"""

from dataclasses import dataclass

# Acceptance before any data: optimistic enough that a cheap draft gets tried, honest in that
# it is below what code reaches (~0.9) and about what prose does.
_PRIOR_RATE = 0.5


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
    lucky streak of a prose request buys less) looked better in a simulation and measured no
    better than 2 on a CPU (docs/benchmarks.md, "Observations behind choices").
    """

    def __init__(
        self,
        k_max: int,
        half_life_steps: float = 16.0,
        prior_strength: float = 2.0,
        prior_rate: float = _PRIOR_RATE,
    ) -> None:
        if k_max < 0 or half_life_steps <= 0 or prior_strength <= 0:
            raise ValueError("k_max must be >= 0, half_life_steps and prior_strength > 0")
        if not 0.0 <= prior_rate <= 1.0:
            raise ValueError(f"prior_rate must be in [0, 1], got {prior_rate}")
        self._k_max = k_max
        self._prior_rate = prior_rate
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
        position p's prior is position p-1's rate (prior_rate for the first), so a position never
        reached carries the last reached one's rate forward; a request's position p's prior is
        the traffic's rate at p.
        """
        s = self._prior_strength
        overall: list[float] = []
        prior = self._prior_rate
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
        # request whose drafts are nearly always accepted took its third and fourth down with
        # it, and it ran at K = 1-2 for several steps where K = 4 pays most
        # (docs/benchmarks.md, "Observations behind choices").
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


def tokens_by_k(rates: list[float], k_max: int) -> list[float]:
    """Expected tokens per step for K = 0..k_max (see expected_tokens_per_step)."""
    tokens = [1.0]
    all_accepted = 1.0
    for rate in rates[:k_max]:
        all_accepted *= rate
        tokens.append(tokens[-1] + all_accepted)
    return tokens


def capped_tokens(tokens: list[float], k_max: int) -> list[float]:
    """Expected tokens per step for K = 0..k_max of a request that verifies at most
    len(tokens) - 1 drafts: K past its cap yields what its cap does."""
    return [tokens[min(k, len(tokens) - 1)] for k in range(k_max + 1)]


def expected_tokens_per_step(rates: list[float], k: int) -> float:
    """1 + sum_{j=1..k} prod_{p<j} rates[p] (bonus token included)."""
    return tokens_by_k(rates, k)[k]
