"""The hybrid proposer's lookups: continuations from a request's own context and from its
tenant's earlier replies, their confidence, the reply index's bound, and pricing."""

from dataclasses import replace

import pytest

from server.autopilot.lookup import (
    MAX_MATCH,
    NGRAM,
    ContextIndex,
    Lookup,
    Proposal,
    ReplyIndex,
)


def test_the_context_proposes_what_followed_the_last_tokens_before() -> None:
    context = ContextIndex()
    # "def f ( x ) : return x" ... then the reply starts the same signature again.
    context.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    proposal = context.find(max_tokens=4)
    assert proposal is not None
    assert proposal.tokens == [4, 5, 6, 7]
    assert proposal.match_length == 3
    assert proposal.origin == "prompt"


def test_the_latest_occurrence_wins_and_the_match_length_counts_back() -> None:
    context = ContextIndex()
    context.extend([9, 1, 2, 3, 10, 8, 9, 1, 2, 3, 11, 7, 8, 9, 1, 2, 3])
    proposal = context.find(max_tokens=2)
    assert proposal is not None
    assert proposal.tokens == [11, 7]  # after the second occurrence
    assert proposal.match_length == 5  # 8 9 1 2 3 agree


def test_the_context_grows_token_by_token() -> None:
    context = ContextIndex()
    tokens = [5, 6, 7, 8]
    context.extend(tokens)
    assert context.find(4) is None  # no n-gram repeats yet
    for token in [5, 6, 7]:
        tokens.append(token)
        context.extend(tokens)
    proposal = context.find(4)
    assert proposal is not None and proposal.tokens == [8, 5, 6, 7]


def test_a_repetition_continues_past_the_context_s_end() -> None:
    context = ContextIndex()
    context.extend([4] * 6)
    proposal = context.find(8)
    assert proposal is not None and proposal.tokens == [4] * 8
    context = ContextIndex()
    context.extend([1, 2, 3, 4, 1, 2, 3])  # period 4: the 4 1 2 3 cycle goes on
    proposal = context.find(6)
    assert proposal is not None and proposal.tokens == [4, 1, 2, 3, 4, 1]


def test_match_length_stops_at_max_match() -> None:
    run = list(range(100, 100 + 2 * MAX_MATCH))
    context = ContextIndex()
    context.extend([*run, 1, *run])
    proposal = context.find(1)
    assert proposal is not None and proposal.match_length == MAX_MATCH


def test_replies_are_proposed_to_their_own_tenant_only() -> None:
    index = ReplyIndex(max_tokens=1000)
    index.add("a", [20, 21, 22, 23, 24, 25])
    mine = index.find("a", [1, 2, 20, 21, 22], max_tokens=8)
    assert mine is not None
    assert (mine.tokens, mine.match_length, mine.origin) == ([23, 24, 25], 3, "replies")
    assert index.find("b", [1, 2, 20, 21, 22], max_tokens=8) is None


def test_the_reply_index_evicts_the_oldest_replies_past_its_bound() -> None:
    index = ReplyIndex(max_tokens=10)
    index.add("a", [1, 2, 3, 4, 5, 6])
    index.add("b", [7, 8, 9, 10])
    assert (index.tokens, index.replies) == (10, 2)
    index.add("a", [11, 12, 13, 14])
    assert (index.tokens, index.replies) == (8, 2)
    assert index.find("a", [1, 2, 3], 4) is None  # the first reply went
    assert index.find("b", [7, 8, 9], 4) is not None
    found = index.find("a", [11, 12, 13], 4)
    assert found is not None and found.tokens == [14]


def test_eviction_keeps_an_n_gram_a_later_reply_indexed_again() -> None:
    index = ReplyIndex(max_tokens=9)
    index.add("a", [1, 2, 3, 4, 5])
    index.add("a", [1, 2, 3, 9])
    index.add("a", [30, 31, 32, 33, 34])  # evicts the first reply only
    assert index.replies == 2
    found = index.find("a", [1, 2, 3], 4)
    assert found is not None and found.tokens == [9]


def test_a_reply_longer_than_the_index_keeps_its_end() -> None:
    index = ReplyIndex(max_tokens=5)
    index.add("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert index.tokens == 5
    found = index.find("a", [4, 5, 6], 4)
    assert found is not None and found.tokens == [7, 8]


def test_a_zero_sized_index_holds_nothing() -> None:
    index = ReplyIndex(max_tokens=0)
    index.add("a", [1, 2, 3, 4, 5])
    assert (index.tokens, index.find("a", [1, 2, 3], 4)) == (0, None)
    with pytest.raises(ValueError):
        ReplyIndex(max_tokens=-1)


def test_the_longer_match_wins_between_context_and_replies() -> None:
    lookup = Lookup(max_tokens=8, index_tokens=1000)
    lookup.finish("old", "a", [40, 41, 42, 43, 1, 2, 3, 50, 51])
    context = [7, 1, 2, 3, 60, 61, 41, 42, 43, 1, 2, 3]
    # Its own context matches 1 2 3 (3 tokens); the reply matches 41 42 43 1 2 3 (6).
    found = lookup.find("r", "a", context, 4)
    assert found is not None and (found.origin, found.tokens) == ("replies", [50, 51])
    own = lookup.find("r2", "b", context, 4)
    assert own is not None and (own.origin, own.tokens) == ("prompt", [60, 61, 41, 42])
    assert lookup.find("r3", None, [1, 2], 4) is None


def test_a_finished_request_s_context_goes_and_its_reply_stays_for_its_tenant() -> None:
    lookup = Lookup(max_tokens=8, index_tokens=1000)
    lookup.find("r", "a", [1, 2, 3, 4], 4)
    lookup.finish("r", "a", [10, 11, 12, 13])
    assert lookup.replies.tokens == 4
    assert lookup._contexts == {}
    lookup.finish("calibration", None, [20, 21, 22, 23])  # no tenant: not indexed
    assert lookup.replies.tokens == 4


def test_verified_length_follows_acceptance_and_price() -> None:
    lookup = Lookup(max_tokens=8, index_tokens=0)
    long_match = Lookup(max_tokens=8, index_tokens=0).find("r", None, [*range(1, 20)] * 2, 8)
    assert long_match is not None and long_match.match_length >= 16
    assert lookup.worth_verifying(long_match, price=0.0) == 8
    # Prior 0.9 per position for long matches: reach 0.9, 0.81, 0.73, 0.66, 0.59, ...
    assert lookup.worth_verifying(long_match, price=0.6) == 4
    before = lookup.expected_tokens(long_match, 8)
    for _ in range(40):
        lookup.observe(long_match, verified=8, accepted=1)
    assert lookup.expected_tokens(long_match, 8) < before
    assert lookup.worth_verifying(long_match, price=0.6) == 1
    # Short matches, and replies, learn apart from long matches in the request's own context.
    assert lookup.rates(Proposal([1], NGRAM, "prompt"))[0] == pytest.approx(0.3)
    assert lookup.rates(replace(long_match, origin="replies"))[0] == pytest.approx(0.9)
