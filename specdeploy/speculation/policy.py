"""Adaptive speculation: how many draft tokens each round asks for (k = 0 is a plain target step).

Pure objects with explicit inputs: the loop (`speculative.speculative_generate`) asks a
`RequestPolicy` for k before each round and reports the round's `RoundOutcome` (counts and the
times it measured) after it; no policy reads a clock, so scripted traces test every decision.

Two layers, as in a server:
  - a `SharedPolicy` (one per served model, its BLS instances sharing its measured state through
    `SharedState`; one per `specdeploy generate` session) holds what is shared by all requests: the
    acceptance gate, the draft-length schedule, and the cost model's measurements (draft step cost,
    verification cost per row count, acceptance over all requests);
  - `SharedPolicy.request()` hands each request its own `RequestPolicy` (its own rolling acceptance).

Policies (recipe `speculative.policy`):
  - `static`: TensorRT-LLM's semantics and names (`tensorrt_llm/llmapi/llm_args.py`,
    `DecodingBaseConfig`): `draft_len_schedule` maps the number of active sequences to a draft
    length, keys are *upper bounds* (since TensorRT-LLM PR #10860: a key N covers every active count
    above the previous key up to N; above the largest key speculation is off); `max_concurrency` N
    turns speculation off above N active and leaves a request's own k below it. The acceptance gate
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

This module holds the settings, the `SharedPolicy` and the two request policies; the measured costs and acceptance
are in `policy_costs`, TensorRT-LLM's schedule and gate in `policy_schedule`, and what the BLS instances of one
server share through files in `policy_sharing` (its names are importable from here too).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Protocol

from specdeploy.speculation.costs import Acceptance, CostModel, RoundOutcome
from specdeploy.speculation.schedule import AcceptanceGate, schedule_from, scheduled_draft_len

# The BLS model (triton/models/tensorrt_llm_bls.py) reads the sharing objects as `policy.X`.

POLICIES = ("static", "cost")

# Acceptance priors and probing (the cost model's own constants are in policy_costs).
PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before anything is measured
PRIOR_WEIGHT = 1.0  # pseudo-trials of the deployment's acceptance in a request's estimate
REQUEST_DECAY = 0.3  # a request's acceptance forgets fast: a draft that stops paying is dropped within two rounds
DEPLOYMENT_DECAY = 0.97
MAX_PROBE_INTERVAL = 64


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
        return cls(
            speculative.policy, speculative.num_draft_tokens, probe_interval=speculative.probe_interval, **kwargs
        )

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


class SharedPolicy:
    """State shared by every request of one deployment (a BLS instance, a generate session)."""

    def __init__(self, settings: PolicySettings, active: Callable[[], int] = lambda: 1):
        self.settings = settings
        self.active = active  # how many sequences are being generated now (this one included)
        self.schedule = schedule_from(settings.draft_len_schedule, settings.max_concurrency)
        self.gate = AcceptanceGate(
            settings.acceptance_rate_window_size, settings.acceptance_rate_threshold, settings.acceptance_measure
        )
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
            "gate": {
                "history": g.history,
                "samples": g.samples,
                "disabled": g.disabled,
                "tripped_mean": g.tripped_mean,
            },
        }

    def load_state(self, state: Mapping | None) -> None:
        """Replace the measured part by `state` (from state()); None: as measured nothing."""
        self.costs, self.acceptance = CostModel(), Acceptance(DEPLOYMENT_DECAY)
        self.gate = AcceptanceGate(self.gate.window, self.gate.threshold, self.gate.measure)
        if state is None:
            return
        c = state["costs"]
        self.costs = CostModel(
            {int(k): v for k, v in c["draft_s"].items()},
            {int(k): v for k, v in c["verify_s"].items()},
            {int(k): v for k, v in c["verify_n"].items()},
            c["plain_token_s"],
        )
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

    def fused_request(self) -> "RequestPolicy":
        """A fused EAGLE-3 call's side (one call per request, the head drafts inside the engine): the schedule and the
        gate cap its k as in StaticPolicy; with policy cost the engine decides draft by draft inside the call
        (engine/draft_cost.py)."""
        return StaticPolicy(self)

    def describe(self) -> str:
        s = self.settings
        parts = [s.policy]
        if s.draft_len_schedule:
            parts.append(f"draft_len_schedule {self.schedule}")
        elif s.max_concurrency is not None:
            parts.append(f"max_concurrency {s.max_concurrency}")
        if self.gate.enabled:
            state = f"off since mean {self.gate.tripped_mean:.2f}" if self.gate.disabled else "open"
            parts.append(f"gate {s.acceptance_rate_window_size}/{s.acceptance_rate_threshold:g} ({state})")
        return ", ".join(parts)


class StaticPolicy:
    """TensorRT-LLM's behaviour: the request's k, capped by the schedule, zero once the gate trips."""

    name = "static"

    def __init__(self, deployment: SharedPolicy):
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

    def __init__(self, deployment: SharedPolicy):
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


def _plain_run(d: SharedPolicy, asked: int, remaining: int) -> int:
    """Plain tokens for one call when k = 0 was not the cost model's choice: all that remain when
    speculation is off for the rest of the request (the gate tripped, or nothing could be drafted: the
    request asked for 0 draft tokens or one token is left); up to probe_interval while the schedule
    holds it off (the active count may fall); else one (a timed plain step)."""
    if d.gate.disabled or asked == 0:
        return max(1, remaining)
    if d.cap(asked) == 0:
        return max(1, min(remaining, d.settings.probe_interval))
    return 1


def _empty_run(d: SharedPolicy, remaining: int) -> int:
    """probe_interval plain tokens when the draft had nothing to propose: replayed with the served call costs, runs
    beat one-token calls after a miss in every category; a run misses a few matches, one-token calls pay a round
    trip for each token (docs/adaptive-speculation.md "Plain runs")."""
    return max(1, min(remaining, d.settings.probe_interval))
