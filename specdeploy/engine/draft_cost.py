"""`speculative.policy: cost` for the fused EAGLE-3 loop: which of the head's drafts a round verifies.

The static policy verifies k = num_draft_tokens drafts every round (cut at the first one whose chain probability, the
head's times the drafts' before it, is less than `draft_p_min`). This one decides draft by draft, inside the engine,
from what this engine measured:

  - V(R): seconds of one engine pass of R rows (all requests' rows of a batched step): a decayed mean per R, and
    through them (passes up to FIT_ROWS rows) a least-squares line, each row costing at least MIN_ROW_SHARE of a
    one-row pass (a few noisy timings never make a row free); the prior slope before two row counts are measured;
  - h: seconds of one head step (a draft after the first: the first draft's logits come with the catch-up the
    head runs in every round anyway, so looking at it is free);
  - cal(p): how often the target accepted a draft the head gave probability p (ten bins, decayed counts, the
    bin's lower edge as prior: the shipped head's measured acceptance lies above p in every bin, README of
    specdeploy/data/heads/, so the prior errs on the side of a plain step), and abar: how often a draft after an
    accepted one was accepted;
  - tau: what a token costs now, engine-wide: a request's seconds per token over its recent drafting rounds (the
    round's head work and its pass; decayed sums), over the requests that share a pass (before any: V(n) / n).

Whether to draft at all: a fused round costs more than its rows (the head catches up on every position), so when
tau is not SPECULATION_MARGIN below what a token costs plainly (a plain round's measured seconds over the n requests
sharing a pass; before one is measured V(n) / n, so the first comparison falls back and measures it), the rounds go
plain, the head idle, for PLAIN_ROUNDS request rounds (doubling after each probe that does not pay, up to
MAX_PLAIN_ROUNDS), then PROBE_ROUNDS rounds draft to measure tau again; the head catches up on the skipped positions
in one pass of its own when drafting resumes.

A draft's survival s_j = cal(p_1) ... cal(p_j) is the chance that it and every draft before it are accepted, its
expected tokens. Maximising tokens per second over many rounds, an action pays when it buys tokens cheaper than
they cost now (Dinkelbach's rule for a ratio): draft j is verified when s_j tau > b (b: a row's slope of V), and
the head drafts j + 1 only when s_j abar tau > h + b. One request alone, whose token costs a whole step, verifies
even drafts the head gives little; four requests sharing a step make a token cost about a quarter of that, and only
drafts the head is sure of are worth a row (docs/eagle3-serving.md "Using it"). Verification decides every token
either way: the output is the target's whatever is drafted (greedy and sampled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdeploy.speculation.costs import PRIOR_VERIFY_SLOPE, SPECULATION_MARGIN, ewma

BINS = 10  # cal(p) in bins of 0.1
CAL_DECAY = 0.995  # weight of earlier drafts in a bin, per new draft there
PRIOR_TRIALS = 2.0  # pseudo-drafts at the bin's lower edge
FIT_ROWS = 32  # passes of up to this many rows fit V(R); longer prefill chunks are another regime
# the least a row costs, as a share of a one-row pass: below what rows measured (docs/eagle3-serving.md "Using it")
MIN_ROW_SHARE = 0.03
PRIOR_ABAR = 0.5  # acceptance of a draft after an accepted one, before any is measured
PLAIN_ROUNDS = 8  # request rounds without the head once drafting stopped paying (the BLS policy's probe_interval)
MAX_PLAIN_ROUNDS = 64
PROBE_ROUNDS = 6  # drafting rounds that measure tau again (the decayed sums then weigh them ~3/4)
ROUND_DECAY = 0.8  # weight of earlier rounds in a request's seconds per token, per new round
PRIOR_HEAD_STEP = 0.08  # a head step in plain steps, before one is timed (bench/eagle3_rounds.py: 0.16 a round of ~2)


@dataclass
class _Rate:
    """Decayed successes / trials with a prior: `rate()` = (s + prior w) / (n + w)."""

    prior: float
    successes: float = 0.0
    trials: float = 0.0

    def observe(self, accepted: bool, decay: float = CAL_DECAY) -> None:
        self.successes = self.successes * decay + float(accepted)
        self.trials = self.trials * decay + 1.0

    def rate(self) -> float:
        return (self.successes + self.prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)


@dataclass
class _Ratio:
    """Seconds per token over recent rounds: decayed sums of both (a ratio of sums, not a mean of per-round ratios,
    which rounds of one token would inflate)."""

    seconds: float = 0.0
    tokens: float = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        self.seconds = self.seconds * ROUND_DECAY + seconds
        self.tokens = self.tokens * ROUND_DECAY + tokens

    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None


@dataclass
class DraftCost:
    """One engine's measurements and the rule above: `speculate()` says whether a round drafts, `round()` hands a
    drafting round its `DraftRound`."""

    clock: object = time.perf_counter
    pass_s: dict[int, float] = field(default_factory=dict)  # rows of a pass -> seconds (decayed mean)
    head_step_s: float | None = None
    calibration: list[_Rate] = field(default_factory=lambda: [_Rate(i / BINS) for i in range(BINS)])
    later: _Rate = field(default_factory=lambda: _Rate(PRIOR_ABAR))  # drafts after an accepted one
    requests: int = 1  # requests in the last pass: the next one will likely hold as many
    drafting: _Ratio = field(default_factory=lambda: _Ratio())  # a request's seconds per token over its drafting rounds
    plain: _Ratio = field(default_factory=lambda: _Ratio())  # ... over its plain rounds (the head idle)
    plain_left: int = 0  # request rounds still to go plain
    probe_left: int = 0  # drafting rounds still to go before deciding again
    plain_rounds: int = PLAIN_ROUNDS  # the next fallback's length
    _line: tuple[float, float] | None = field(default=None, repr=False)  # line() until the next pass is timed

    def speculate(self) -> bool:
        """Whether this round drafts (see the module's docstring); counts the round."""
        if self.plain_left > 0:
            self.plain_left -= 1
            if self.plain_left == 0:
                self.probe_left = PROBE_ROUNDS
            return False
        if self.probe_left > 0:
            self.probe_left -= 1
            return True
        if self.drafting.per_token() is None or not self.pass_s:
            return True
        if self.token_seconds() < (1.0 - SPECULATION_MARGIN) * self.plain_token_seconds():
            self.plain_rounds = PLAIN_ROUNDS
            return True
        # this round is the first plain one
        self.plain_left, self.plain_rounds = self.plain_rounds - 1, min(MAX_PLAIN_ROUNDS, 2 * self.plain_rounds)
        if self.plain_left == 0:
            self.probe_left = PROBE_ROUNDS
        return False

    def observe_pass(self, rows: int, seconds: float, requests: int) -> None:
        self.pass_s[rows] = ewma(self.pass_s.get(rows), seconds)
        self.requests = max(1, requests)
        self._line = None

    def observe_round(self, seconds: float, tokens: int) -> None:
        """One request's drafting round: its head work and its pass took `seconds` and gave `tokens`."""
        self.drafting.observe(seconds, tokens)

    def observe_plain_round(self, seconds: float) -> None:
        self.plain.observe(seconds, 1)

    def token_seconds(self) -> float:
        """tau: what a token costs now, engine-wide (a request's seconds per token over the requests sharing a pass)."""
        per_token = self.drafting.per_token()
        if per_token is None or not self.pass_s:
            return self.plain_token_seconds()
        return per_token / self.requests

    def plain_token_seconds(self) -> float:
        """What a token costs without drafting, engine-wide: a request's plain round over the requests sharing a pass
        (before one is measured: V(n) / n, the passes alone)."""
        per_token = self.plain.per_token()
        return (per_token if per_token is not None else self.pass_seconds(self.requests)) / self.requests

    def observe_head_step(self, seconds: float) -> None:
        self.head_step_s = ewma(self.head_step_s, seconds)

    def bin_of(self, draft_prob: float) -> _Rate:
        return self.calibration[min(BINS - 1, max(0, int(draft_prob * BINS)))]

    def accepted_share(self, draft_prob: float) -> float:
        """cal(p): the measured share of drafts with the head's probability p that the target accepted."""
        return self.bin_of(draft_prob).rate()

    def line(self) -> tuple[float, float]:
        """(V(1), seconds per further row): a least-squares line through the measured passes of up to FIT_ROWS rows
        (all of them when none is that short); one row count: the prior slope through it; none: (1, prior slope), in
        units of a one-row pass. Computed once per timed pass (a round asks for it several times)."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        points = [(r, s) for r, s in self.pass_s.items() if r <= FIT_ROWS] or list(self.pass_s.items())
        if not points:
            return 1.0, PRIOR_VERIFY_SLOPE
        if len(points) == 1:
            ((rows, seconds),) = points
            one = seconds / (1.0 + PRIOR_VERIFY_SLOPE * (rows - 1))
            return one, PRIOR_VERIFY_SLOPE * one
        mean_r = sum(r for r, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        slope = sum((r - mean_r) * (s - mean_s) for r, s in points) / sum((r - mean_r) ** 2 for r, _ in points)
        one = mean_s - slope * (mean_r - 1)
        if one <= 0:  # timings too noisy for a line: the cheapest pass measured, the least row cost
            one = min(s for _, s in points)
        return one, max(slope, MIN_ROW_SHARE * one)

    def pass_seconds(self, rows: int) -> float:
        """V(rows), on the line."""
        one, per_row = self.line()
        return one + per_row * (rows - 1)

    def head_seconds(self) -> float:
        if self.head_step_s is None or not self.pass_s:  # the prior, in the unit pass_seconds uses now
            return PRIOR_HEAD_STEP * self.pass_seconds(1)
        return self.head_step_s

    def round(self) -> "DraftRound":
        return DraftRound(self)


class DraftRound:
    """One request's round: `more()` before each head step after the first draft, `verify(p)` for each draft with
    the head's probability p, then `outcome(accepted, seconds)` after the target verified them (Eagle3Drafter.draft,
    Executor._fused_round)."""

    def __init__(self, cost: DraftCost):
        self.cost = cost
        self.token_s = cost.token_seconds()  # tau, fixed for the round
        self.row_s = cost.line()[1]  # b
        self.survival = 1.0
        self.draft_probs: list[float] = []
        self._stepped_at: float | None = None

    def more(self) -> bool:
        """Whether the head should draft one more token (a head step) after the ones verified so far."""
        if self.survival * self.cost.later.rate() * self.token_s <= self.cost.head_seconds() + self.row_s:
            return False
        self._stepped_at = self.cost.clock()
        return True

    def verify(self, draft_prob: float) -> bool:
        """Whether the draft the head gave probability `draft_prob` is worth its row (then it is counted in)."""
        if self._stepped_at is not None:
            self.cost.observe_head_step(self.cost.clock() - self._stepped_at)
            self._stepped_at = None
        survival = self.survival * self.cost.accepted_share(draft_prob)
        if survival * self.token_s <= self.row_s:
            return False
        self.survival = survival
        self.draft_probs.append(draft_prob)
        return True

    def outcome(self, accepted: int, seconds: float) -> None:
        """The target accepted the first `accepted` drafts, the round took `seconds` (head and pass): drafts up to the
        first rejected one are evidence for cal and abar; the round's seconds per token for tau."""
        for j, draft_prob in enumerate(self.draft_probs[: accepted + 1]):
            ok = j < accepted
            self.cost.bin_of(draft_prob).observe(ok)
            if j > 0:
                self.cost.later.observe(ok)
        self.cost.observe_round(seconds, accepted + 1)
