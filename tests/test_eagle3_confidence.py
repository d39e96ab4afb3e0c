"""bench/eagle3_confidence.py's pure parts: acceptance by the head's probability and the cut-off sweep, on rounds
whose numbers are worked out by hand."""

from __future__ import annotations

import pytest

import bench_modules

ROUNDS = [  # k = 3: the head's probability of each draft, and how many of the round's drafts the target accepted
    {"probabilities": [0.95, 0.9, 0.8], "accepted": 3},
    {"probabilities": [0.55, 0.15, 0.9], "accepted": 2},
    {"probabilities": [0.05, 0.5, 0.5], "accepted": 0},
    {"probabilities": [0.12, 0.5, 0.5], "accepted": 1},
]


def test_first_draft_acceptance_by_probability_bins():
    conf = bench_modules.load("eagle3_confidence")
    assert conf.by_probability(ROUNDS) == [(0.0, 1, 0.0), (0.1, 1, 1.0), (0.5, 1, 1.0), (0.9, 1, 1.0)]


def test_sweep_cuts_each_round_at_its_first_draft_below_the_cut_and_costs_it():
    conf = bench_modules.load("eagle3_confidence")
    rows, head = (1.0, 1.1, 1.2, 1.3, 1.4), 0.1
    table = {row["draft_p_min"]: row for row in conf.sweep(ROUNDS, rows, head)}
    # no cut-off: 3 drafts every round, 6 accepted; each round costs 1.3 + 3 * 0.1
    assert table[0.0]["drafted_per_round"] == 3 and table[0.0]["accepted_per_round"] == 6 / 4
    assert table[0.0]["estimated_speedup"] == pytest.approx((4 + 6) / (4 * 1.6))
    # 0.2: rounds draft 3, 1 (0.15 < 0.2 stops the second), 0, 0; accepted 3 + min(1, 2) = 4
    assert table[0.2]["drafted_per_round"] == 4 / 4 and table[0.2]["accepted_per_round"] == 4 / 4
    assert table[0.2]["estimated_speedup"] == pytest.approx((4 + 4) / ((1.3 + 0.3) + (1.1 + 0.1) + 2 * (1.0 + 0.1)))
    # 0.7 keeps only the sure round
    assert table[0.7]["drafted_per_round"] == 3 / 4 and table[0.7]["accepted_per_round"] == 3 / 4


def test_acceptance_by_group_is_per_category_or_source_and_per_draft_position():
    conf = bench_modules.load("eagle3_confidence")
    rounds = [dict(r, prompt=p) for r, p in zip(ROUNDS, ("code-0", "code-1", "chat-0", "calibration-12-3/0"))]
    groups = {name: (n, mean, shares) for name, n, mean, shares in conf.by_group(rounds, 3)}
    assert groups["code"] == (2, 2.5, [1.0, 1.0, 0.5])  # accepted 3 and 2: both rounds kept drafts 1 and 2
    assert groups["chat"] == (1, 0.0, [0.0, 0.0, 0.0]) and groups["calibration"] == (1, 1.0, [1.0, 0.0, 0.0])
    assert groups["all"] == (4, 1.5, [0.75, 0.5, 0.25])
