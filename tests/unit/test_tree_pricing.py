"""Pricing the suffix trees' proposals: the tree's own estimates until measured, calibrated
toward what the target accepted per origin, match class and estimate bucket, short matches
priced like any, and the cut where a position's worth falls under the verify price."""

import pytest

from server.autopilot.suffix_tree import Proposal, SuffixProposer
from server.autopilot.tree_pricing import PRIOR_STRENGTH, TreePricing


def proposal(probs: list[float], match_length: int = 20, origin: str = "prompt") -> Proposal:
    return Proposal(list(range(len(probs))), probs, match_length, 1, origin)


def test_unmeasured_a_proposal_is_priced_as_its_tree_estimates_it() -> None:
    pricing = TreePricing()
    found = proposal([0.8, 0.4, 0.4])  # the second position followed half the time
    assert pricing.rates(found) == pytest.approx([0.8, 0.5, 1.0])
    assert pricing.expected_tokens(found, 0) == 1.0
    assert pricing.expected_tokens(found, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.4)


def test_calibration_moves_the_estimate_toward_measured_acceptance() -> None:
    pricing = TreePricing()
    copy = proposal([1.0] * 8)
    for _ in range(40):
        pricing.observe(copy, verified=8, accepted=1)  # each second position rejected
    # Reached twice a step, accepted once: near one half, from the tree's certainty.
    rates = pricing.rates(copy)
    assert rates == pytest.approx([rates[0]] * 8)
    assert 0.5 < rates[0] < 0.55
    assert pricing.expected_tokens(copy, 8) < 2.2
    # And up where the tree was doubtful and the target accepts everything.
    doubtful = proposal([0.3, 0.09])
    before = pricing.rates(doubtful)
    for _ in range(40):
        pricing.observe(doubtful, verified=2, accepted=2)
    assert before == pytest.approx([0.3, 0.3])
    assert all(0.9 < rate <= 1.0 for rate in pricing.rates(doubtful))


def test_one_observation_moves_the_price_by_the_prior_s_weight() -> None:
    pricing = TreePricing()
    pricing.observe(proposal([1.0]), verified=1, accepted=0)
    (rate,) = pricing.rates(proposal([1.0]))
    assert rate == pytest.approx(PRIOR_STRENGTH / (PRIOR_STRENGTH + 1))


def test_each_origin_match_class_and_estimate_learns_apart() -> None:
    pricing = TreePricing()
    for _ in range(40):
        pricing.observe(proposal([1.0] * 8), verified=8, accepted=0)
    assert pricing.rates(proposal([1.0] * 8))[0] < 0.2
    assert pricing.rates(proposal([1.0], origin="replies")) == [1.0]
    assert pricing.rates(proposal([1.0], match_length=1)) == [1.0]  # a one-token match
    assert pricing.rates(proposal([0.6])) == [0.6]


def test_matches_of_one_and_two_tokens_price_as_any() -> None:
    pricing = TreePricing()
    short = SuffixProposer(index_tokens=0).find("r", None, [7, 1, 7, 2, 7], 4)
    assert short is not None and short.match_length == 1
    assert pricing.rates(short) == [0.5]
    assert pricing.worth_verifying(short, price=0.4) == 1
    assert pricing.worth_verifying(short, price=0.6) == 0
    assert pricing.expected_tokens(short, 1) == pytest.approx(1.5)
    for _ in range(40):
        pricing.observe(short, verified=1, accepted=1)
    assert pricing.rates(short)[0] > 0.9
    two = proposal([1.0, 1.0], match_length=2)
    assert pricing.worth_verifying(two, price=0.5) == 2
    pricing.observe(two, verified=2, accepted=1)


def test_worth_verifying_cuts_where_the_price_exceeds_a_position_s_worth() -> None:
    pricing = TreePricing()
    # Each position's chance that it and all before it are accepted: the tree's probs.
    found = proposal([1.0, 0.8, 0.5, 0.3])
    assert pricing.worth_verifying(found, price=0.0) == 4
    assert pricing.worth_verifying(found, price=0.25) == 4
    assert pricing.worth_verifying(found, price=0.45) == 3
    assert pricing.worth_verifying(found, price=0.9) == 1
    assert pricing.worth_verifying(found, price=1.1) == 0


def test_observations_must_make_sense() -> None:
    with pytest.raises(ValueError):
        TreePricing().observe(proposal([1.0, 1.0]), verified=1, accepted=2)


def test_a_run_of_lookups_ends_at_even_odds_until_measured_then_as_measured() -> None:
    pricing = TreePricing()
    short, copy = proposal([1.0], match_length=1), proposal([1.0] * 8)
    assert pricing.run_ends(short) == pricing.run_ends(copy) == 0.5
    for _ in range(40):
        pricing.observe_run(short, ended=True)  # chat: a short match, then the draft again
        pricing.observe_run(copy, ended=False)  # a copy runs on
    assert pricing.run_ends(short) > 0.9
    assert pricing.run_ends(copy) < 0.1
    assert pricing.run_ends(proposal([1.0], match_length=1, origin="replies")) == 0.5
