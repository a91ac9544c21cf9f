"""Free proposals for the hybrid proposer: continuations looked up in a request's own context (its
prompt and its reply so far) and in its tenant's recent replies, with no forward pass at all.

A match is found by the context's last NGRAM tokens (the latest earlier place they occurred with
a token after them); its confidence is how far back it agrees with the context (match length,
up to MAX_MATCH). Acceptance is learnt per origin and confidence bucket (a long match is
usually a copy in progress, a short one often a coincidence), so the scheduler can weigh a lookup
against the draft model's proposal for the same request and price how many of its tokens are
worth verifying. Replies are indexed per tenant, in one index bounded in tokens over all tenants
(oldest reply evicted first): no tenant is ever proposed another tenant's text.

Stdlib only; the autopilot's scheduler (server/vllm_plugins/autopilot_scheduler.py) asks it for each
decoding request's proposal every step and hands it each finished reply.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from server.autopilot.acceptance import AcceptanceTracker, tokens_by_k

NGRAM = 3  # tokens a match is found by: the shortest match there is
MAX_MATCH = 32  # how far back a match's agreement is measured
# Three token ids packed into one int key. Ids past 2**21 (no tokenizer has that many) would only
# make two n-grams share a key: a wrong proposal the target rejects, never a wrong output.
_ID_BITS = 21
_ID_MASK = (1 << _ID_BITS) - 1
# The shortest match lengths of the confidence buckets, and the per-position acceptance each is
# assumed to have until measured: optimistic enough for long matches that a copy in progress is
# tried against a good draft, doubtful of three-token coincidences.
BUCKET_STARTS = (3, 5, 8, 16)
_BUCKET_PRIORS = (0.3, 0.5, 0.75, 0.9)


def _key(tokens: Sequence[int], end: int) -> int:
    """The n-gram of the NGRAM tokens before `end`."""
    return (
        ((tokens[end - 3] & _ID_MASK) << (2 * _ID_BITS))
        | ((tokens[end - 2] & _ID_MASK) << _ID_BITS)
        | (tokens[end - 1] & _ID_MASK)
    )


def _match_length(source: Sequence[int], end: int, context: Sequence[int]) -> int:
    """How many tokens before `end` in source equal the context's last ones (at most MAX_MATCH)."""
    length = 0
    last = len(context)
    while (
        length < MAX_MATCH
        and length < end
        and source[end - 1 - length] == context[last - 1 - length]
    ):
        length += 1
    return length


def bucket(match_length: int) -> int:
    """The confidence bucket of a match length."""
    return max(i for i, start in enumerate(BUCKET_STARTS) if match_length >= start)


@dataclass(frozen=True)
class Proposal:
    """A looked-up continuation."""

    tokens: list[int]
    match_length: int  # tokens of context the match agrees on: its confidence
    origin: str  # "prompt" (the request's own context) or "replies" (its tenant's replies)


class ContextIndex:
    """One request's context (prompt and reply so far) and where each of its n-grams last
    occurred with a token after it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._next: dict[int, int] = {}  # n-gram -> the position of the token after it

    def extend(self, all_tokens: Sequence[int]) -> None:
        """Catch up with the request's tokens (they only grow)."""
        known = len(self.tokens)
        if len(all_tokens) <= known:
            return
        self.tokens.extend(all_tokens[known:])
        tokens, index = self.tokens, self._next
        # Index every n-gram whose next token exists; the context's own last n-gram has none.
        for start in range(max(known, NGRAM), len(tokens)):
            index[_key(tokens, start)] = start

    def find(self, max_tokens: int) -> Proposal | None:
        tokens = self.tokens
        if len(tokens) <= NGRAM:
            return None
        start = self._next.get(_key(tokens, len(tokens)))
        if start is None:
            return None
        match = _match_length(tokens, start, tokens)
        # Past the context's end the continuation repeats itself: a match `period` tokens back
        # predicts that the next tokens repeat the last `period` (a loop writing one line again).
        period = len(tokens) - start
        proposal = [tokens[start + i % period] for i in range(max_tokens)]
        return Proposal(proposal, match, "prompt")


class ReplyIndex:
    """Recent replies, indexed per tenant, at most max_tokens tokens over all tenants."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0  # held now
        self._replies: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # oldest first
        # tenant -> n-gram -> serial << 32 | position of the token after it in that reply
        self._next: dict[str, dict[int, int]] = {}
        self._serial = 0

    @property
    def replies(self) -> int:
        return len(self._replies)

    def add(self, tenant: str, reply: Sequence[int]) -> None:
        if self.max_tokens == 0 or len(reply) <= NGRAM:
            return
        tokens = list(reply[-self.max_tokens :])
        serial = self._serial
        self._serial += 1
        self._replies[serial] = (tenant, tokens)
        index = self._next.setdefault(tenant, {})
        for start in range(NGRAM, len(tokens)):
            index[_key(tokens, start)] = serial << 32 | start
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        serial, (tenant, tokens) = self._replies.popitem(last=False)
        index = self._next[tenant]
        for start in range(NGRAM, len(tokens)):
            key = _key(tokens, start)
            if index.get(key) == serial << 32 | start:  # not overwritten by a later reply
                del index[key]
        if not index:
            del self._next[tenant]
        self.tokens -= len(tokens)

    def find(self, tenant: str, context: Sequence[int], max_tokens: int) -> Proposal | None:
        index = self._next.get(tenant)
        if index is None or len(context) < NGRAM:
            return None
        hit = index.get(_key(context, len(context)))
        if hit is None:
            return None
        _, tokens = self._replies[hit >> 32]
        start = hit & 0xFFFFFFFF
        match = _match_length(tokens, start, context)
        return Proposal(tokens[start : start + max_tokens], match, "replies")


ORIGINS = ("prompt", "replies")


class Lookup:
    """The hybrid's lookup side: each live request's context index, the tenants' reply index,
    and acceptance per origin and confidence bucket."""

    def __init__(self, max_tokens: int, index_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.replies = ReplyIndex(index_tokens)
        self._contexts: dict[str, ContextIndex] = {}
        self._acceptance = {
            (origin, i): AcceptanceTracker(max_tokens, half_life_steps=32.0, prior_rate=prior)
            for origin in ORIGINS
            for i, prior in enumerate(_BUCKET_PRIORS)
        }

    def find(
        self, request_id: str, tenant: str | None, all_tokens: Sequence[int], max_tokens: int
    ) -> Proposal | None:
        """The most confident continuation of the request's context (its own first on a tie),
        at most max_tokens long; None below NGRAM tokens of agreement."""
        context = self._contexts.setdefault(request_id, ContextIndex())
        context.extend(all_tokens)
        best = context.find(max_tokens)
        if tenant is not None:
            other = self.replies.find(tenant, context.tokens, max_tokens)
            if other is not None and (best is None or other.match_length > best.match_length):
                best = other
        if best is None or best.match_length < NGRAM or not best.tokens:
            return None
        return best

    def rates(self, proposal: Proposal) -> list[float]:
        """Per-position conditional acceptance of lookups of this origin and confidence."""
        return self._tracker(proposal).position_rates()

    def _tracker(self, proposal: Proposal) -> AcceptanceTracker:
        return self._acceptance[proposal.origin, bucket(proposal.match_length)]

    def expected_tokens(self, proposal: Proposal, length: int) -> float:
        """Tokens a verify step of the proposal's first `length` tokens is expected to give
        (bonus included)."""
        return tokens_by_k(self.rates(proposal), length)[length]

    def worth_verifying(self, proposal: Proposal, price: float) -> int:
        """How many of the proposal's tokens to verify: each while the chance that it and all
        before it are accepted is at least `price` (one verified token's cost in output
        tokens)."""
        length, reach = 0, 1.0
        for rate in self.rates(proposal)[: len(proposal.tokens)]:
            reach *= rate
            if reach < price:
                break
            length += 1
        return length

    def observe(self, proposal: Proposal, verified: int, accepted: int) -> None:
        self._tracker(proposal).observe("lookup", verified, accepted)

    def finish(self, request_id: str, tenant: str | None, reply: Sequence[int]) -> None:
        """The request left the engine: its context goes, its reply joins its tenant's index."""
        self._contexts.pop(request_id, None)
        if tenant is not None:
            self.replies.add(tenant, reply)
