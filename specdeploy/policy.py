"""Adaptive speculation: how many draft tokens each round asks for (k = 0 is a plain target step).

Pure objects with explicit inputs: the loop (`speculative.speculative_generate`) asks a
`RequestPolicy` for k before each round and reports the round's `RoundOutcome` (counts and the
times it measured) after it; no policy reads a clock, so scripted traces test every decision.

Two layers, as in a server:
  - a `Deployment` (one per served model, its BLS instances sharing its measured state through
    `SharedState`; one per `specdeploy generate` session) holds what is shared by all requests: the
    acceptance gate, the draft-length schedule, and the cost model's measurements (draft step cost,
    verification cost per row count, acceptance over all requests);
  - `Deployment.request()` hands each request its own `RequestPolicy` (its own rolling acceptance).

Policies (recipe `speculative.policy`):
  - `static`: TensorRT-LLM's semantics and names (`tensorrt_llm/llmapi/llm_args.py`,
    `DecodingBaseConfig`): `draft_len_schedule` maps the number of active sequences to a draft
    length, keys are *upper bounds* (since TensorRT-LLM PR #10860: a key N covers every active count
    above the previous key up to N; above the largest key speculation is off); `max_concurrency` is
    the shorthand {max_concurrency: num_draft_tokens}. The acceptance gate
    (`acceptance_rate_window_size`, `acceptance_rate_threshold`; `_torch/speculative/
    speculation_gate.py`) records each speculating round's acceptance rate (accepted / drafted) and,
    once a full rolling window has been seen, turns speculation off for good when the window's mean is
    below the threshold.
  - `cost`: ours. Each round it predicts tokens per second for every k in 0..cap from the measured
    costs and the request's rolling acceptance and picks the best; k = 0 is a plain step. A request
    whose draft stops paying falls back to plain decoding on the next round and probes again after
    `probe_interval` plain tokens (doubling after each probe that does not pay, up to
    MAX_PROBE_INTERVAL), so it can come back. The schedule's cap and the gate apply to it too.

Plain runs: when a policy chooses k = 0 it also says how many plain tokens the target may generate in
that one call (`plain_tokens`): the rest of the answer once speculation is off for good (the gate, or a
request that asked for no draft tokens), the tokens until the next probe while the cost policy has
fallen back, one while it is still timing a plain step. A served fallback then costs about what the
target alone costs (one call for many tokens), not one BLS round trip per token.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol

from specdeploy.artifacts import pid_alive

POLICIES = ("static", "cost")

# Cost-model constants (written once; see CostModel).
PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before anything is measured
PRIOR_WEIGHT = 1.0  # pseudo-trials of the deployment's acceptance in a request's estimate
REQUEST_DECAY = 0.3  # a request's acceptance forgets fast: a draft that stops paying is dropped within two rounds
DEPLOYMENT_DECAY = 0.97
COST_EWMA = 0.3  # weight of a new timing sample
PRIOR_VERIFY_SLOPE = 0.1  # verification cost per extra row, in plain steps, before two row counts are measured
MIN_SAMPLES = 2  # timing samples a row count needs before exploration stops asking for it
# A speculating k must be predicted this much faster than plain steps to be chosen: the prediction is as noisy
# as the timings it comes from, and a round trip's overheads vary, so a k predicted at break-even loses about
# half the time (the fresh `make demo` speculated 51 % of its rounds at acceptance 0.96 and ran at 0.91x).
SPECULATION_MARGIN = 0.05
MAX_PROBE_INTERVAL = 64


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


class RequestPolicy(Protocol):
    """One request's side of a policy: k for the next round, then that round's outcome."""

    name: str

    def choose(self, cap: int) -> int: ...

    def record(self, outcome: RoundOutcome) -> None: ...

    def plain_tokens(self, remaining: int) -> int:
        """After choose() returned 0: how many plain tokens (1..remaining) the target generates in one call."""
        ...

    def empty_run(self, remaining: int) -> int:
        """After choose() returned k > 0 and the draft proposed nothing (an n-gram without a match): the plain
        tokens (1..remaining) the target generates in one call instead."""
        ...


# ---------------------------------------------------------------- TensorRT-LLM's pieces


def scheduled_draft_len(schedule: Mapping[int, int] | None, active: int, default: int) -> int:
    """Draft length for `active` sequences under TensorRT-LLM's `draft_len_schedule` (upper bounds).

    {2: 4, 4: 2}: 1-2 active -> 4, 3-4 -> 2, 5 or more -> 0 (off). No schedule: `default`.
    """
    if not schedule:
        return default
    keys = sorted(schedule)
    i = bisect_left(keys, max(1, active))  # the smallest key >= active
    return schedule[keys[i]] if i < len(keys) else 0


def schedule_from(draft_len_schedule: Mapping[int, int] | None, max_concurrency: int | None, num_draft_tokens: int) -> dict[int, int] | None:
    """The effective schedule: the explicit one, or max_concurrency's shorthand, or None."""
    if draft_len_schedule:
        return dict(draft_len_schedule)
    if max_concurrency is not None:
        return {max_concurrency: num_draft_tokens}
    return None


class AcceptanceGate:
    """TensorRT-LLM's SpeculationGate: a rolling mean of per-round acceptance rates over `window`
    rounds; after at least `window` samples, a mean below `threshold` disables speculation for good.
    window 0 (or threshold 0) means no gate. measure "length" (TensorRT-LLM before PR #12905 gated on
    the mean accepted length of completed requests) records the tokens each speculating round emitted."""

    def __init__(self, window: int, threshold: float, measure: str = "rate"):
        self.window, self.threshold, self.measure = window, threshold, measure
        self.history: list[float] = []
        self.samples = 0
        self.disabled = False
        self.tripped_mean: float | None = None

    @property
    def enabled(self) -> bool:
        return self.window > 0 and self.threshold > 0

    def record(self, sample: float) -> bool:
        """Record one speculating round's sample; True when this call turns speculation off."""
        if not self.enabled or self.disabled:
            return False
        assert sample >= 0.0 and (self.measure == "length" or sample <= 1.0), sample
        self.history.append(sample)
        if len(self.history) > self.window:
            self.history.pop(0)
        self.samples += 1
        if self.samples >= self.window:
            mean = sum(self.history) / len(self.history)
            if mean < self.threshold:
                self.disabled, self.tripped_mean = True, mean
                return True
        return False


# ---------------------------------------------------------------- the cost model


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
            self.plain_token_s = _ewma(self.plain_token_s, outcome.target_time_s / outcome.emitted)
            return
        rows = outcome.rows
        self.verify_s[rows] = _ewma(self.verify_s.get(rows), outcome.target_time_s)
        self.verify_n[rows] = self.verify_n.get(rows, 0) + 1
        if outcome.k > 0 and outcome.draft_fresh:
            self.draft_s[outcome.k] = _ewma(self.draft_s.get(outcome.k), outcome.draft_time_s)

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
        return bool(self.draft_s) and not self.unmeasured(1) and any(not self.unmeasured(r) for r in self.verify_n if r > 1)

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


def _ewma(old: float | None, new: float) -> float:
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


# ---------------------------------------------------------------- deployment and requests


@dataclass(frozen=True)
class PolicySettings:
    """The recipe's `speculative` policy keys, as the loop needs them."""

    policy: str = "static"
    num_draft_tokens: int = 4
    draft_len_schedule: Mapping[int, int] | None = None
    max_concurrency: int | None = None
    acceptance_rate_window_size: int = 0
    acceptance_rate_threshold: float = 0.0
    acceptance_measure: str = "rate"  # rate: accepted / drafted per round; length: tokens emitted per round
    probe_interval: int = 8

    def __post_init__(self):
        assert self.policy in POLICIES, self.policy
        assert self.acceptance_measure in ("rate", "length"), self.acceptance_measure

    @classmethod
    def from_recipe(cls, speculative) -> "PolicySettings":
        """From a recipe's `speculative` section (config.SpeculativeConfig): policy, num_draft_tokens and
        `dynamic` (draft_len_schedule as [[up_to_active, draft_len], ...], max_concurrency, the gate)."""
        d = speculative.dynamic
        kwargs = {}
        if d is not None:
            kwargs = {
                "draft_len_schedule": {int(bound): int(length) for bound, length in d.draft_len_schedule} or None,
                "max_concurrency": d.max_concurrency,
                "acceptance_rate_window_size": d.acceptance_window or 0,
                "acceptance_rate_threshold": d.acceptance_threshold or 0.0,
                "acceptance_measure": d.acceptance_measure,
            }
        return cls(speculative.policy, speculative.num_draft_tokens, probe_interval=speculative.probe_interval, **kwargs)

    def to_parameters(self) -> dict[str, str]:
        """The settings as Triton model parameters (strings); `from_parameters` reads them back."""
        import json

        return {
            "speculation_policy": self.policy,
            "draft_len_schedule": json.dumps(self.draft_len_schedule or {}),
            "max_concurrency": "" if self.max_concurrency is None else str(self.max_concurrency),
            "acceptance_rate_window_size": str(self.acceptance_rate_window_size),
            "acceptance_rate_threshold": repr(self.acceptance_rate_threshold),
            "acceptance_measure": self.acceptance_measure,
            "probe_interval": str(self.probe_interval),
        }

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], num_draft_tokens: int) -> "PolicySettings":
        import json

        if "speculation_policy" not in params:
            return cls("static", num_draft_tokens)
        schedule = {int(k): int(v) for k, v in json.loads(params.get("draft_len_schedule") or "{}").items()}
        concurrency = params.get("max_concurrency") or ""
        return cls(
            params["speculation_policy"],
            num_draft_tokens,
            schedule or None,
            int(concurrency) if concurrency else None,
            int(params.get("acceptance_rate_window_size") or 0),
            float(params.get("acceptance_rate_threshold") or 0.0),
            params.get("acceptance_measure") or "rate",
            int(params.get("probe_interval") or 8),
        )


class Deployment:
    """State shared by every request of one deployment (a BLS instance, a generate session)."""

    def __init__(self, settings: PolicySettings, active: Callable[[], int] = lambda: 1):
        self.settings = settings
        self.active = active  # how many sequences are being generated now (this one included)
        self.schedule = schedule_from(settings.draft_len_schedule, settings.max_concurrency, settings.num_draft_tokens)
        self.gate = AcceptanceGate(settings.acceptance_rate_window_size, settings.acceptance_rate_threshold, settings.acceptance_measure)
        self.costs = CostModel()
        self.acceptance = Acceptance(DEPLOYMENT_DECAY)
        self.journal: list[RoundOutcome] | None = None  # outcomes not yet shared (SharedState sets it)

    def record(self, outcome: RoundOutcome) -> None:
        """Add one round to what all requests share: measured costs, acceptance, the gate."""
        self.costs.observe(outcome)
        self.acceptance.observe(outcome.drafted, outcome.accepted)
        if outcome.drafted > 0:
            gate = self.gate
            gate.record(outcome.accepted / outcome.drafted if gate.measure == "rate" else float(outcome.accepted + 1))
        if self.journal is not None:
            self.journal.append(outcome)

    def state(self) -> dict:
        """The measured part (costs, acceptance, gate) as JSON-ready data; the settings are not in it."""
        g = self.gate
        return {
            "costs": asdict(self.costs),
            "acceptance": asdict(self.acceptance),
            "gate": {"history": g.history, "samples": g.samples, "disabled": g.disabled, "tripped_mean": g.tripped_mean},
        }

    def load_state(self, state: Mapping | None) -> None:
        """Replace the measured part by `state` (from state()); None: as measured nothing."""
        self.costs, self.acceptance = CostModel(), Acceptance(DEPLOYMENT_DECAY)
        self.gate = AcceptanceGate(self.gate.window, self.gate.threshold, self.gate.measure)
        if state is None:
            return
        c = state["costs"]
        self.costs = CostModel(
            {int(k): v for k, v in c["draft_s"].items()}, {int(k): v for k, v in c["verify_s"].items()},
            {int(k): v for k, v in c["verify_n"].items()}, c["plain_token_s"],
        )  # fmt: skip
        self.acceptance = Acceptance(**state["acceptance"])
        for name, value in state["gate"].items():
            setattr(self.gate, name, value)

    def cap(self, requested: int) -> int:
        """The most draft tokens a round may ask for now: the request's k, the schedule, the gate."""
        if self.gate.disabled:
            return 0
        return max(0, min(requested, scheduled_draft_len(self.schedule, self.active(), requested)))

    def request(self) -> "RequestPolicy":
        if self.settings.policy == "cost":
            return CostPolicy(self)
        return StaticPolicy(self)

    def describe(self) -> str:
        s = self.settings
        parts = [s.policy]
        if self.schedule:
            parts.append(f"draft_len_schedule {self.schedule}")
        if self.gate.enabled:
            state = f"off since mean {self.gate.tripped_mean:.2f}" if self.gate.disabled else "open"
            parts.append(f"gate {s.acceptance_rate_window_size}/{s.acceptance_rate_threshold:g} ({state})")
        return ", ".join(parts)


class StaticPolicy:
    """TensorRT-LLM's behaviour: the request's k, capped by the schedule, zero once the gate trips."""

    name = "static"

    def __init__(self, deployment: Deployment):
        self.deployment = deployment
        self.asked = 0  # the cap of the last choose()

    def choose(self, cap: int) -> int:
        self.asked = cap
        return self.deployment.cap(cap)

    def record(self, outcome: RoundOutcome) -> None:
        self.deployment.record(outcome)

    def plain_tokens(self, remaining: int) -> int:
        return _plain_run(self.deployment, self.asked, remaining)

    def empty_run(self, remaining: int) -> int:
        return _empty_run(self.deployment, remaining)


class CostPolicy:
    """Best predicted tokens per second each round, k = 0 included; probes to come back."""

    name = "cost"

    def __init__(self, deployment: Deployment):
        self.deployment = deployment
        self.acceptance = Acceptance(REQUEST_DECAY)
        self.plain_rounds = 0  # consecutive rounds with k = 0 since the last speculating round
        self.probe_interval = deployment.settings.probe_interval
        self.probing = False
        self.explore_turn = 0
        self.asked = self.cap = 0  # the cap the loop offered in the last choose(), and what the deployment allowed
        self.fell_back = False  # the last choose() returned 0 because the cost model prefers plain steps

    def alpha(self) -> float:
        d = self.deployment
        shared = d.acceptance.rate(PRIOR_ACCEPTANCE, PRIOR_WEIGHT)
        return self.acceptance.rate(shared, PRIOR_WEIGHT)

    def choose(self, cap: int) -> int:
        d = self.deployment
        self.asked = cap
        cap = self.cap = d.cap(cap)
        self.probing = self.fell_back = False
        if cap == 0:
            return 0
        costs = d.costs
        # Exploration before the model can be trusted: two speculating rounds (the second times a draft
        # that is up to date), then two plain steps, until each has been timed.
        if not costs.calibrated():
            self.explore_turn += 1
            return cap if self.explore_turn % 4 in (1, 2) or not costs.unmeasured(1) else 0
        best = costs.best_k(self.alpha(), cap)
        assert best is not None
        if best > 0:
            return best
        if self.plain_rounds >= self._probe_after(cap):
            self.probing = True
            return max(1, costs.best_k(max(self.alpha(), d.acceptance.rate(PRIOR_ACCEPTANCE, PRIOR_WEIGHT)), cap) or 1)
        self.fell_back = True
        return 0

    def _probe_after(self, cap: int) -> int:
        """Plain tokens before the next probe: probe_interval (doubling after probes that did not pay), or
        MAX_PROBE_INTERVAL when even a draft that is always right would not pay at the measured costs
        (every k's (k + 1) tokens cost more than k + 1 plain tokens): a probe could then only lose."""
        return MAX_PROBE_INTERVAL if self._hopeless(cap) else self.probe_interval

    def _hopeless(self, cap: int) -> bool:
        """No k up to cap pays at the measured costs, even with a draft that is always right."""
        return self.deployment.costs.best_k(1.0, cap) == 0

    def plain_tokens(self, remaining: int) -> int:
        """Fallen back: the plain tokens until the next probe, in one call. Held off by the schedule while the
        measured costs say no k could pay even with a draft that is always right: MAX_PROBE_INTERVAL tokens
        (re-checking the active count sooner could only let it speculate at a loss). Else as `_plain_run`
        says (one token while exploration still times a plain step)."""
        if self.fell_back:
            return max(1, min(remaining, self._probe_after(self.cap) - self.plain_rounds))
        d = self.deployment
        if self.asked > 0 and self.cap == 0 and not d.gate.disabled and self._hopeless(self.asked):
            return max(1, min(remaining, MAX_PROBE_INTERVAL))
        return _plain_run(d, self.asked, remaining)

    def empty_run(self, remaining: int) -> int:
        return _empty_run(self.deployment, remaining)

    def record(self, outcome: RoundOutcome) -> None:
        d = self.deployment
        self.acceptance.observe(outcome.drafted, outcome.accepted)
        d.record(outcome)
        if outcome.k == 0:
            self.plain_rounds += max(1, outcome.emitted)  # plain tokens since the last speculating round
            return
        if self.probing:
            # The probe paid when the model now picks speculation again; else wait twice as long.
            again = d.costs.best_k(self.alpha(), outcome.k)
            if not again:
                self.probe_interval = min(MAX_PROBE_INTERVAL, self.probe_interval * 2)
            else:
                self.probe_interval = d.settings.probe_interval
        self.plain_rounds = 0


def _plain_run(d: Deployment, asked: int, remaining: int) -> int:
    """Plain tokens for one call when k = 0 was not the cost model's choice: all that remain when
    speculation is off for the rest of the request (the gate tripped, or nothing could be drafted: the
    request asked for 0 draft tokens or one token is left); up to probe_interval while the schedule
    holds it off (the active count may fall); else one (a timed plain step)."""
    if d.gate.disabled or asked == 0:
        return max(1, remaining)
    if d.cap(asked) == 0:
        return max(1, min(remaining, d.settings.probe_interval))
    return 1


def _empty_run(d: Deployment, remaining: int) -> int:
    """probe_interval plain tokens when the draft had nothing to propose. Replaying SmolLM2's greedy answers to
    the 32 built-in prompts through the n-gram pool of build/smollm2-135m-ngram.yaml with the served call costs
    (one call: ~6.5 ms + 12.2 ms per token; 2 rows 19.6 ms, 5 rows 32 ms), the served speedup per category (chat,
    code, reasoning, summarisation) is 0.67/0.74/0.70/0.82 with one-token calls after a miss, 0.94/0.98/0.95/1.05
    with runs of 8: a run misses a few matches, one-token calls pay a round trip for each token."""
    return max(1, min(remaining, d.settings.probe_interval))


# ---------------------------------------------------------------- what the BLS instances of one server share


class ActiveCount:
    """How many BLS instances (processes) are generating now: each instance keeps a file `<pid>` in
    `folder` holding 1 while it serves a request; dead processes are not counted. Not pure (files), so
    kept apart from the policies, which only receive the number."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.mine = self.folder / str(os.getpid())
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        tmp = self.mine.with_suffix(".tmp")
        tmp.write_text("1" if busy else "0")
        os.replace(tmp, self.mine)

    def close(self, when_last=()) -> None:
        """Remove this process's file; once no live instance is left, also the files `when_last` and the folder
        (each instance removes its own file before it looks, so the last one to look sees none)."""
        self.mine.unlink(missing_ok=True)
        if any(self._live()):
            return
        for path in when_last:
            path.unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass

    def __call__(self) -> int:
        return max(1, sum(busy for _, busy in self._live()))

    def _live(self):
        """(file, busy) of each instance whose process is alive."""
        for path in self.folder.iterdir():
            if path.name.isdigit() and pid_alive(int(path.name)):
                try:
                    yield path, path.read_text().strip() == "1"
                except OSError:  # gone since the listing
                    continue


INSTANCES_PREFIX = "specdeploy-active-"  # + a hash of the model repository: ActiveCount's and SharedState's folder
ABANDONED_AFTER_S = 60.0


def instances_folder(parent, model_repository: str) -> Path:
    """The folder the BLS instances serving `model_repository` share (ActiveCount, SharedState)."""
    digest = hashlib.sha256(str(model_repository).encode()).hexdigest()[:12]
    return Path(parent) / (INSTANCES_PREFIX + digest)


def remove_abandoned(parent) -> int:
    """Remove the instances' folders (INSTANCES_PREFIX) under `parent` that no live process uses: no file in them
    is named after a live pid (an instance `<pid>`, a server's `policy-<pid>.*`) and nothing in them changed for
    ABANDONED_AFTER_S (a server that is starting keeps its new folder). A server that was killed, or stopped before
    its stubs finalized, leaves its folder behind; each BLS instance sweeps when it starts. Returns how many went."""
    now, removed = time.time(), 0
    for folder in Path(parent).glob(INSTANCES_PREFIX + "*"):
        try:
            if now - folder.stat().st_mtime < ABANDONED_AFTER_S:
                continue
            files = list(folder.iterdir())
            if any(_owned_by_live_process(f.name) for f in files):
                continue
            for f in files:
                f.unlink(missing_ok=True)
            folder.rmdir()
            removed += 1
        except OSError:  # changed meanwhile, or not ours to remove
            continue
    return removed


class SharedState:
    """One server's measured deployment state (costs, acceptance, the gate), shared by its BLS instances through
    `policy-<server pid>.json` in the instances' folder. An instance loads the newest state before each request
    (`pull`) and, when the request ends, replays that request's round outcomes onto the newest state under a lock
    (`push`): the instances calibrate, learn acceptance and trip the gate as one deployment (TensorRT-LLM's gate
    belongs to the executor), instead of each one exploring on its own share of the requests. A restarted server
    starts afresh (its pid names a new file); files of servers that are gone are removed."""

    def __init__(self, folder, deployment: Deployment, server_pid: int):
        self.path = Path(folder) / f"policy-{server_pid}.json"
        self.deployment = deployment
        self.version = 0  # of the state this instance last loaded or wrote
        deployment.journal = []
        for stale in Path(folder).glob("policy-*"):
            if not _owned_by_live_process(stale.name):
                stale.unlink(missing_ok=True)

    def pull(self) -> None:
        shared = self._read()
        if shared is not None and shared["version"] != self.version:
            self.deployment.load_state(shared["state"])
            self.version = shared["version"]

    def push(self) -> None:
        """Add the rounds recorded since the last push to the shared state. Sharing saves calibration, it is not
        needed to serve: when the folder cannot be written (disk full, removed) this instance goes on with what it
        measured itself and says so on stderr (the server log)."""
        d = self.deployment
        journal, d.journal = d.journal, []
        if not journal:
            return
        try:
            with open(self.files[1], "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                shared = self._read()
                d.load_state(shared["state"] if shared else None)
                for outcome in journal:
                    d.record(outcome)
                d.journal = []
                self.version = (shared["version"] if shared else 0) + 1
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"version": self.version, "state": d.state()}))
                os.replace(tmp, self.path)
        except OSError as exc:
            d.journal = []
            print(f"specdeploy: could not share the speculation policy's measurements ({exc}); this instance keeps its own", file=sys.stderr)

    @property
    def files(self) -> tuple[Path, Path]:
        """The state and its lock: the server's last instance removes them (ActiveCount.close)."""
        return self.path, self.path.with_suffix(".lock")

    def _read(self) -> dict | None:
        """The shared state; None when there is none yet, or what is there cannot be read (then it starts afresh)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None


def _owned_by_live_process(name: str) -> bool:
    """Whether the pid a file of the instances' folder is named after (`<pid>`, `policy-<server pid>.json`, the
    first number in the name) is alive."""
    found = re.search(r"\d+", name)
    return found is not None and pid_alive(int(found.group()))
