"""The speculation policy's cost model: what one round measured (`RoundOutcome`), the tokens a round is expected
to emit at an acceptance rate, the deployment's measured draft and verification costs (`CostModel`) and decayed
per-token acceptance (`Acceptance`). Pure arithmetic over explicit inputs; `specdeploy.speculation.policy` decides with
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# Cost-model constants (written once; see CostModel).
COST_EWMA = 0.3  # weight of a new timing sample
PRIOR_VERIFY_SLOPE = 0.1  # verification cost per extra row, in plain steps, before two row counts are measured
MIN_SAMPLES = 2  # timing samples a row count needs before exploration stops asking for it
# A speculating k must be predicted this much faster than plain steps to be chosen: the prediction is as noisy
# as the timings it comes from, and a round trip's overheads vary, so a k predicted at break-even loses about
# half the time (docs/adaptive-speculation.md "policy: cost").
SPECULATION_MARGIN = 0.05


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did: the k asked for, tokens drafted/accepted/emitted, and measured seconds."""

    k: int
    drafted: int
    accepted: int
    emitted: int
    draft_time_s: float
    target_time_s: float
    draft_fresh: bool = True  # False when the draft first had to catch up (the prompt, or tokens of k = 0 rounds)
    first_round: bool = False  # the target's time includes the prompt's prefill
    plain_run: int = 1  # k = 0: the plain tokens the target was asked for in this one call

    @property
    def is_run(self) -> bool:
        """A plain call that generated several tokens (its time is per-token cost times emitted)."""
        return self.k == 0 and self.plain_run > 1 and self.emitted > 1

    @property
    def rows(self) -> int:
        """Positions the target scored: the draft tokens plus its own."""
        return self.drafted + 1


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round emits with per-token acceptance alpha and k draft tokens (Leviathan et al.
    2023): (1 - alpha^(k+1)) / (1 - alpha); k = 0 gives 1."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _estimate(table: Mapping[int, float], x: int, proportional: bool) -> float | None:
    """Value at x from measured points: exact, else linear through the two nearest points, else
    (one point) proportional scaling (draft: time ~ k) or the prior verification slope."""
    if x in table:
        return table[x]
    if not table:
        return None
    points = sorted(table)
    if len(points) == 1:
        x0, y0 = points[0], table[points[0]]
        if proportional:
            return y0 * x / x0 if x0 else y0
        plain = y0 / (1.0 + PRIOR_VERIFY_SLOPE * (x0 - 1))
        return plain * (1.0 + PRIOR_VERIFY_SLOPE * (x - 1))
    below = [p for p in points if p < x]
    above = [p for p in points if p > x]
    if below and above:
        x0, x1 = below[-1], above[0]
    elif below:
        x0, x1 = below[-2], below[-1]
    else:
        x0, x1 = above[0], above[1]
    y0, y1 = table[x0], table[x1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class CostModel:
    """Measured costs of one deployment: draft seconds per k, verification seconds per row count
    (rows = k + 1; rows 1 is a plain target step), each an exponentially weighted mean."""

    draft_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[int, float] = field(default_factory=dict)
    verify_n: dict[int, int] = field(default_factory=dict)
    plain_token_s: float | None = None  # seconds per token of a plain run (many tokens in one target call)

    def observe(self, outcome: RoundOutcome) -> None:
        if outcome.first_round:  # prefill time says nothing about a round's cost
            return
        if outcome.is_run:
            self.plain_token_s = ewma(self.plain_token_s, outcome.target_time_s / outcome.emitted)
            return
        rows = outcome.rows
        self.verify_s[rows] = ewma(self.verify_s.get(rows), outcome.target_time_s)
        self.verify_n[rows] = self.verify_n.get(rows, 0) + 1
        if outcome.k > 0 and outcome.draft_fresh:
            self.draft_s[outcome.k] = ewma(self.draft_s.get(outcome.k), outcome.draft_time_s)

    def round_seconds(self, k: int) -> float | None:
        """Predicted seconds of a round with k draft tokens; k = 0 is one plain token, at the cheaper of
        a one-row step and a plain run's per-token cost (a fallback runs plain tokens in one call)."""
        verify = _estimate(self.verify_s, k + 1, proportional=False)
        if verify is None:
            return None
        if k == 0:
            return verify if self.plain_token_s is None else min(verify, self.plain_token_s)
        draft = _estimate(self.draft_s, k, proportional=True)
        return None if draft is None else verify + draft

    def tokens_per_s(self, alpha: float, k: int) -> float | None:
        seconds = self.round_seconds(k)
        return None if seconds is None or seconds <= 0 else expected_tokens(alpha, k) / seconds

    def unmeasured(self, rows: int) -> bool:
        return self.verify_n.get(rows, 0) < MIN_SAMPLES

    def calibrated(self) -> bool:
        """A plain step and at least one speculating row count have MIN_SAMPLES timings each, and a
        draft call has been timed."""
        return (
            bool(self.draft_s)
            and not self.unmeasured(1)
            and any(not self.unmeasured(r) for r in self.verify_n if r > 1)
        )

    def best_k(self, alpha: float, cap: int) -> int | None:
        """argmax over k in 0..cap of predicted tokens per second (ties to the smaller k), where a k > 0 must
        beat plain steps by SPECULATION_MARGIN; None until a plain step and a speculating round have been timed."""
        scores = [(self.tokens_per_s(alpha, k), k) for k in range(cap + 1)]
        if any(s is None for s, _ in scores):
            return None
        best = max(scores[1:], key=lambda sk: (sk[0], -sk[1]), default=None)
        if best is None or best[0] < scores[0][0] * (1.0 + SPECULATION_MARGIN):
            return 0
        return best[1]


def ewma(old: float | None, new: float) -> float:
    """The decayed mean with a new sample (COST_EWMA); the sample itself when there is none yet."""
    return new if old is None else (1.0 - COST_EWMA) * old + COST_EWMA * new


@dataclass
class Acceptance:
    """Per-token acceptance as decayed successes / trials: a round with k drafted and a accepted is
    a successes and, when a < k, one failure (the geometric model's maximum-likelihood estimate)."""

    decay: float
    successes: float = 0.0
    failures: float = 0.0
    rounds: int = 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1 if accepted < drafted else 0)
        self.rounds += 1

    def rate(self, prior: float, prior_weight: float) -> float:
        """The estimate with `prior` counted as prior_weight trials; the prior fades like old evidence."""
        weight = prior_weight * self.decay**self.rounds
        return (self.successes + prior * weight) / (self.successes + self.failures + weight)
