"""`validate --time-budget`: the timed phases cut to what fits at the mean request time so far (fit_budget is
pure arithmetic on the plan; the served run is in tests/test_validate_foreign.py)."""

from __future__ import annotations

from collections import Counter

from specdeploy.client.options import Options
from specdeploy.client.prompts import Prompt
from specdeploy.client.validate import fit_budget

CATEGORIES = ("chat", "code", "summarization", "reasoning")
TIMED = [Prompt(f"{c}-{i}", "x", c, 8) for i in range(2) for c in CATEGORIES]
# 100 requests in the first 100 s: 1 s a request; one repeat at concurrency 1 and 2 sends 2 x 8 x 2 = 32
PLAN = {"parity": 64, "baseline": 0, "sampling": 0, "warm_up": 36}


def _fit(left_s: float, repeats: int = 4):
    options = Options(repeats=repeats, concurrency=(1, 2), time_budget_s=100.0 + left_s)
    plan = dict(PLAN)
    fitted, kept = fit_budget(options, TIMED, 100.0, plan)
    return fitted.repeats, kept, plan["budget"]


def test_a_budget_that_fits_changes_nothing():
    repeats, kept, budget = _fit(200.0)
    assert (repeats, kept, budget["fits"]) == (4, TIMED, True) and budget["per_request_s"] == 1.0


def test_repeats_go_first_and_stay_even():
    repeats, kept, budget = _fit(100.0)  # 4 repeats need 128 s, 3 would fit (96) but are odd: 2
    assert (repeats, kept, budget["fits"]) == (2, TIMED, True)
    assert _fit(200.0, repeats=5)[0] == 5  # the asked count, odd or not, where it fits
    assert _fit(150.0, repeats=5)[0] == 4


def test_then_timed_prompts_go_spread_over_the_categories():
    repeats, kept, budget = _fit(40.0)  # 2 repeats x 2 levels x 2 sides = 8 s a prompt: 5 prompts
    assert repeats == 2 and len(kept) == 5 and budget["fits"]
    assert set(Counter(p.category for p in kept)) == set(CATEGORIES)


def test_a_budget_below_the_smallest_run_keeps_the_smallest_and_says_it_does_not_fit():
    repeats, kept, budget = _fit(1.0)
    assert repeats == 2 and len(kept) == len(CATEGORIES) and not budget["fits"]
    assert _fit(-50.0)[2]["fits"] is False  # the budget already spent before the timed phases
