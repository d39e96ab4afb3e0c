"""speculative.policy cost in the fused EAGLE-3 loop (specdeploy/engine/draft_cost.py): scripted costs and
probabilities, every decision computed by hand from the rule in the module's docstring."""

from __future__ import annotations

import pytest

from specdeploy.engine.draft_cost import (
    BINS,
    CAL_DECAY,
    FIT_ROWS,
    MIN_ROW_SHARE,
    PLAIN_ROUNDS,
    PRIOR_HEAD_STEP,
    PROBE_ROUNDS,
    DraftCost,
)
from specdeploy.speculation.costs import PRIOR_VERIFY_SLOPE

# a 2-core CPU's shape (ms): one row 6, each further row 0.6
PASSES = {1: 6.0, 2: 6.6, 3: 7.2, 4: 7.8, 5: 8.4, 6: 9.0, 7: 9.6, 8: 10.2}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def measured(requests: int, head_step: float | None = 0.5) -> DraftCost:
    cost = DraftCost(clock=Clock())
    for rows, seconds in PASSES.items():
        cost.observe_pass(rows, seconds, requests)
    if head_step is not None:
        cost.observe_head_step(head_step)
    return cost


def test_a_draft_is_verified_when_its_survival_pays_for_its_row():
    """One request: a token costs V(1) / 1 = 6 (no round measured yet: the plain price), a row 0.6: cal(p) > 0.1 is
    worth it (prior: the bin's lower edge)."""
    alone = measured(requests=1)
    assert alone.round().verify(0.25)  # 0.2 * 6 = 1.2 > 0.6
    assert not alone.round().verify(0.05)  # 0 * 6 < 0.6
    # four requests share the pass: a token costs V(4) / 4 = 1.95, so 0.25 (0.39) no longer pays, 0.45 (0.78) does
    shared = measured(requests=4)
    assert not shared.round().verify(0.25)
    assert shared.round().verify(0.45)


def test_later_drafts_need_the_survival_of_every_draft_before_them():
    alone = measured(requests=1)
    r = alone.round()
    assert r.verify(0.65) and r.survival == pytest.approx(0.6)
    assert r.more()  # 0.6 * 0.5 (abar prior) * 6 = 1.8 > head 0.5 + row 0.6
    assert r.verify(0.35)  # survival 0.18 * 6 = 1.08 > 0.6
    assert r.survival == pytest.approx(0.6 * 0.3)
    assert not r.more()  # 0.18 * 0.5 * 6 = 0.54 < 1.1: no more head steps
    r = alone.round()
    assert r.verify(0.35) and not r.more()  # 0.3 * 0.5 * 6 = 0.9 < 1.1


def test_the_head_step_is_timed_between_more_and_verify():
    cost = measured(requests=1, head_step=None)
    assert cost.head_seconds() == pytest.approx(PRIOR_HEAD_STEP * 6.0)  # the prior, in measured seconds
    r = cost.round()
    assert r.verify(0.95) and r.more()
    cost.clock.now += 0.25
    r.verify(0.95)
    assert cost.head_step_s == pytest.approx(0.25)


def test_before_any_pass_is_measured_the_rule_works_in_units_of_a_one_row_pass():
    cost = DraftCost()
    assert cost.pass_seconds(1) == 1.0 and cost.pass_seconds(3) == pytest.approx(1.2)
    assert cost.round().verify(0.95) and not cost.round().verify(0.05)


def test_outcomes_calibrate_the_bins_up_to_the_first_rejected_draft():
    cost = measured(requests=1, head_step=0.1)
    r = cost.round()
    assert r.verify(0.95) and r.more() and r.verify(0.95) and r.more() and r.verify(0.95)
    r.outcome(1, 8.0)  # the first accepted, the second rejected: the third says nothing
    top = cost.calibration[BINS - 1]
    assert top.trials == pytest.approx(1 + CAL_DECAY) and top.successes == pytest.approx(
        CAL_DECAY
    )  # accepted, then not
    assert cost.later.trials == pytest.approx(1.0) and cost.later.successes == 0.0
    assert cost.drafting.per_token() == pytest.approx(4.0)  # 8 s for 2 tokens


def test_a_head_that_is_right_more_often_than_it_says_earns_its_rows():
    """Four requests: a draft at p = 0.15 starts below its row's worth (0.1 * 1.95 < 0.6); after 60 such drafts
    all accepted, its bin says ~0.97 and it is verified."""
    cost = measured(requests=4)
    assert not cost.round().verify(0.15)
    for _ in range(60):
        cost.calibration[1].observe(True)
    assert cost.accepted_share(0.15) > 0.9
    assert cost.round().verify(0.15)


def test_tau_is_a_requests_seconds_per_token_over_the_requests_sharing_a_pass():
    cost = measured(requests=1)
    assert cost.token_seconds() == pytest.approx(6.0)  # nothing drafted yet: the plain price V(1) / 1
    cost.observe_pass(2, 6.6, 2)
    assert cost.requests == 2 and cost.token_seconds() == pytest.approx(3.3)  # V(2) / 2
    cost.observe_round(8.0, 2)
    assert cost.token_seconds() == pytest.approx(2.0)  # 4 s a token for each of 2 requests
    cost.observe_round(3.0, 1)  # a ratio of decayed sums: (0.8 * 8 + 3) / (0.8 * 2 + 1), over 2 requests
    assert cost.token_seconds() == pytest.approx((0.8 * 8 + 3) / (0.8 * 2 + 1) / 2)
    cost.observe_pass(1, 6.0, 0)
    assert cost.requests == 1


def test_rounds_go_plain_while_drafting_does_not_pay_and_probe_again():
    """One request, plain price 6 s a token: rounds at 7 s a token fall back for PLAIN_ROUNDS rounds, then
    PROBE_ROUNDS draft, then (still 7) twice as many plain ones; at 3 s a token every round drafts."""
    cost = measured(requests=1)
    assert cost.speculate()  # nothing measured: draft
    cost.observe_round(7.0, 1)
    decisions = [cost.speculate() for _ in range(PLAIN_ROUNDS + PROBE_ROUNDS + 2 * PLAIN_ROUNDS + 1)]
    assert decisions == [False] * PLAIN_ROUNDS + [True] * PROBE_ROUNDS + [False] * (2 * PLAIN_ROUNDS) + [True]
    for _ in range(PROBE_ROUNDS):  # the probes measure 3 s a token
        cost.observe_round(3.0, 1)
    assert cost.token_seconds() < 5.7  # scripted seconds: below 0.95 x the plain price of 6
    cost.probe_left = 0
    assert all(cost.speculate() for _ in range(20)) and cost.plain_rounds == PLAIN_ROUNDS


def test_the_pass_line_fits_the_measured_passes_and_never_makes_a_row_free():
    cost = measured(requests=1)
    one, per_row = cost.line()
    assert one == pytest.approx(6.0) and per_row == pytest.approx(0.6)
    noisy = DraftCost()
    for rows, seconds in {1: 6.0, 2: 5.5, 3: 5.9, 4: 5.4}.items():  # bigger passes timed faster: noise
        noisy.observe_pass(rows, seconds, 1)
    assert noisy.line()[1] == pytest.approx(MIN_ROW_SHARE * noisy.line()[0])
    prefill = DraftCost()
    prefill.observe_pass(64, 40.0, 1)  # only a prompt's pass: the prior slope through it
    one, per_row = prefill.line()
    assert one * (1 + PRIOR_VERIFY_SLOPE * 63) == pytest.approx(40.0) and per_row == pytest.approx(
        PRIOR_VERIFY_SLOPE * one
    )
    prefill.observe_pass(FIT_ROWS + 1, 30.0, 1)
    prefill.observe_pass(2, 6.0, 1)  # one short pass: a line through the passes of up to FIT_ROWS rows, here one
    assert prefill.line()[0] == pytest.approx(6.0 / (1 + PRIOR_VERIFY_SLOPE))


def test_the_plain_price_is_measured_on_plain_rounds():
    cost = measured(requests=2)
    assert cost.plain_token_seconds() == pytest.approx(3.3)  # V(2) / 2 before a plain round is timed
    cost.observe_plain_round(8.0)
    assert cost.plain_token_seconds() == pytest.approx(4.0)
    cost.observe_round(7.8, 1)  # drafting: 3.9 s a token engine-wide, not 5 % below 4
    assert not cost.speculate()
