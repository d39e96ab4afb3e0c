"""Writing the metrics: `Recorder` turns request and round events into counter increments, gauge moves and histogram
observations on a `Sink`; `BlsOps` is what tensorrt_llm_bls does for metrics and the canary (arm per request, the
metered policy, the control arm's plain verifier)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

from specdeploy.core.metrics.names import (
    ACCEPTANCE_LENGTH,
    ACCEPTED_PER_POS,
    ACCEPTED_TOKENS,
    ARMS,
    CONTROL_ARM,
    DRAFT_SECONDS,
    DRAFT_TOKENS,
    DRAFT_TOKENS_PER_POS,
    DRAFTS,
    E2E,
    GENERATION_TOKENS,
    LOOKUP_ACCEPTED_TOKENS,
    LOOKUP_DRAFT_TOKENS,
    LOOKUP_DRAFTS,
    PROMPT_TOKENS,
    REASON_CONTROL_ARM,
    REASON_DRAFT_P_MIN,
    REASON_GATE,
    REASON_LAST_TOKEN,
    REASON_NO_DRAFT,
    REASON_NO_PROPOSAL,
    REASON_NONE,
    REASON_POLICY,
    REASON_SCHEDULE,
    REQUEST_ERRORS,
    REQUESTS,
    ROUNDS,
    RUNNING,
    SPEC_OFF,
    SPEC_ON,
    SPECULATIVE_ARM,
    TARGET_PASSES,
    TARGET_SECONDS,
    TPOT,
    TTFT,
)
from specdeploy.core.metrics.sinks import Sink, TritonSink

CANARY_ENV = (  # overrides the BLS parameter (the Kubernetes control Deployment sets 100)
    "SPECDEPLOY_CANARY_CONTROL_PERCENT"
)


@dataclass
class RequestTimer:
    arm: str
    start_s: float
    first_token_s: float | None = None
    output_tokens: int = 0
    pieces: int = 0  # how many times tokens arrived (TPOT needs at least two)
    requested_k: bool = True

    def tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now
        self.output_tokens += n
        self.pieces += 1


class Recorder:
    """What the speculative entry point reports, per request and per round, for one model."""

    def __init__(self, sink: Sink, model: str, max_draft_len: int, clock=time.perf_counter):
        self.sink, self.model, self.max_draft_len, self.clock = sink, model, max_draft_len, clock
        self.length_buckets = tuple(float(n) for n in range(1, max_draft_len + 2))

    def _labels(self, arm: str, **extra) -> dict[str, str]:
        return {"model": self.model, "arm": arm, **{k: str(v) for k, v in extra.items()}}

    def declare_all(self) -> None:
        """Create every series a request can touch, at zero, before the first request (the model's `initialize`):
        the endpoint shows them from the start, and no request pays for creating them."""
        for arm in ARMS:
            for metric in (
                REQUESTS,
                REQUEST_ERRORS,
                PROMPT_TOKENS,
                GENERATION_TOKENS,
                RUNNING,
                DRAFTS,
                DRAFT_TOKENS,
                ACCEPTED_TOKENS,
                TARGET_PASSES,
                DRAFT_SECONDS,
                TARGET_SECONDS,
                LOOKUP_DRAFTS,
                LOOKUP_DRAFT_TOKENS,
                LOOKUP_ACCEPTED_TOKENS,
            ):
                self.sink.declare(metric, self._labels(arm))
            for metric in (E2E, TTFT, TPOT):
                self.sink.declare(metric, self._labels(arm), metric.buckets)
            self.sink.declare(ACCEPTANCE_LENGTH, self._labels(arm), self.length_buckets)
            for pos in range(self.max_draft_len):
                self.sink.declare(DRAFT_TOKENS_PER_POS, self._labels(arm, position=pos))
                self.sink.declare(ACCEPTED_PER_POS, self._labels(arm, position=pos))
            self.sink.declare(ROUNDS, self._labels(arm, speculation=SPEC_ON, reason=REASON_NONE))
            for reason in (
                REASON_LAST_TOKEN,
                REASON_CONTROL_ARM,
                REASON_GATE,
                REASON_SCHEDULE,
                REASON_POLICY,
                REASON_NO_DRAFT,
                REASON_NO_PROPOSAL,
                REASON_DRAFT_P_MIN,
            ):
                self.sink.declare(ROUNDS, self._labels(arm, speculation=SPEC_OFF, reason=reason))

    def request_started(self, arm: str) -> RequestTimer:
        assert arm in ARMS, arm
        self.sink.add(RUNNING, self._labels(arm), 1)
        return RequestTimer(arm, self.clock())

    def round(
        self,
        arm: str,
        drafted: int,
        accepted: int,
        emitted: int,
        draft_s: float,
        target_s: float,
        reason: str | None = None,
        lookup: bool = False,
    ) -> None:
        """One target pass: `drafted` draft tokens proposed, `accepted` of them kept, `emitted` new tokens; `lookup`:
        the drafts were the request's own text (EAGLE-3 draft.sa_config), counted also in the lookup series."""
        labels = self._labels(arm)
        on = drafted > 0
        self.sink.add(
            ROUNDS,
            self._labels(
                arm,
                speculation=SPEC_ON if on else SPEC_OFF,
                reason=REASON_NONE if on else (reason or REASON_LAST_TOKEN),
            ),
            1,
        )
        self.sink.add(TARGET_PASSES, labels, 1)
        self.sink.add(TARGET_SECONDS, labels, target_s)
        if draft_s:  # also a round whose draft work proposed nothing (no match, the head unsure): it cost time
            self.sink.add(DRAFT_SECONDS, labels, draft_s)
        if on:
            self.sink.add(DRAFTS, labels, 1)
            self.sink.add(DRAFT_TOKENS, labels, drafted)
            self.sink.add(ACCEPTED_TOKENS, labels, accepted)
            if lookup:
                self.sink.add(LOOKUP_DRAFTS, labels, 1)
                self.sink.add(LOOKUP_DRAFT_TOKENS, labels, drafted)
                self.sink.add(LOOKUP_ACCEPTED_TOKENS, labels, accepted)
            for pos in range(drafted):
                self.sink.add(DRAFT_TOKENS_PER_POS, self._labels(arm, position=pos), 1)
                if pos < accepted:
                    self.sink.add(ACCEPTED_PER_POS, self._labels(arm, position=pos), 1)
            self.sink.observe(ACCEPTANCE_LENGTH, labels, float(emitted), self.length_buckets)

    def request_finished(self, timer: RequestTimer, prompt_tokens: int, ok: bool = True) -> None:
        labels = self._labels(timer.arm)
        self.sink.add(RUNNING, labels, -1)
        if not ok:
            self.sink.add(REQUEST_ERRORS, labels, 1)
            return
        now = self.clock()
        latency = now - timer.start_s
        self.sink.add(REQUESTS, labels, 1)
        self.sink.add(PROMPT_TOKENS, labels, prompt_tokens)
        self.sink.add(GENERATION_TOKENS, labels, timer.output_tokens)
        self.sink.observe(E2E, labels, latency, E2E.buckets)
        if timer.first_token_s is not None:
            ttft = timer.first_token_s - timer.start_s
            self.sink.observe(TTFT, labels, ttft, TTFT.buckets)
            if timer.output_tokens >= 2 and timer.pieces >= 2:  # all tokens at once (the plain path): no TPOT
                self.sink.observe(TPOT, labels, (latency - ttft) / (timer.output_tokens - 1), TPOT.buckets)


class MeteredPolicy:
    """Wraps a specdeploy.speculation.policy RequestPolicy: one `Recorder.round` per round, with why speculation was
    off."""

    def __init__(
        self, inner, recorder: Recorder, timer: RequestTimer, deployment=None, forced_reason: str | None = None
    ):
        self.inner, self.recorder, self.timer, self.deployment, self.forced_reason = (
            inner,
            recorder,
            timer,
            deployment,
            forced_reason,
        )
        self.name = getattr(inner, "name", "static") if inner is not None else "static"
        self.reason: str | None = None

    def choose(self, cap: int) -> int:
        k = self.inner.choose(cap) if self.inner is not None else cap
        self.reason = self.forced_reason or (None if k > 0 else self._why_off(cap))
        return k

    def _why_off(self, cap: int) -> str:
        d = self.deployment
        if cap == 0:
            return REASON_LAST_TOKEN if self.timer.requested_k else REASON_NO_DRAFT
        if d is not None and getattr(getattr(d, "gate", None), "disabled", False):
            return REASON_GATE
        if d is not None and d.cap(cap) == 0:
            return REASON_SCHEDULE
        return REASON_POLICY

    def plain_tokens(self, remaining: int) -> int:
        """The inner policy's plain run after k = 0 (specdeploy.speculation.policy); the control arm's PlainVerifier
        asks for the rest itself."""
        return self.inner.plain_tokens(remaining) if self.inner is not None else 1

    def empty_run(self, remaining: int) -> int:
        """The inner policy's plain run after an empty proposal."""
        return self.inner.empty_run(remaining) if self.inner is not None else 1

    def record(self, outcome) -> None:
        reason = self.reason or (REASON_NO_PROPOSAL if outcome.drafted == 0 else None)  # chose k > 0, drafted nothing
        self.recorder.round(
            self.timer.arm,
            outcome.drafted,
            outcome.accepted,
            outcome.emitted,
            outcome.draft_time_s,
            outcome.target_time_s,
            reason,
        )
        if self.inner is not None:
            self.inner.record(outcome)


class PlainVerifier:
    """The canary's control arm: the target alone, the rest of the answer in one call (no draft).

    `inner.verify` must take `output_len` (the BLS's TritonVerifier does)."""

    def __init__(self, inner, max_tokens: int, prompt_len: int):
        self.inner, self.max_tokens, self.prompt_len = inner, max_tokens, prompt_len

    def verify(self, sequence, draft_tokens, draft_logits, sampling):
        assert not draft_tokens, "the control arm drafts nothing"
        remaining = self.max_tokens - (len(sequence) - self.prompt_len)
        return self.inner.verify(sequence, [], None, sampling, output_len=max(remaining, 1))


@dataclass
class FusedRounds:
    """A fused EAGLE-3 call's passes as rounds, the prefill pass first: k and accepted drafts of each, and its seconds
    (the head's work before it, the engine pass; empty where the model did not return them)."""

    k: list[int]
    accepted: list[int]
    draft_s: list[float]
    target_s: list[float]


def _fused_plain_reason(
    i: int,
    k: int,
    max_draft_len: int,
    max_tokens: int,
    emitted: list[int],
    drafted_rounds: list[int],
    policy: str = "static",
) -> str:
    """Why pass i of a fused EAGLE-3 request (k > 0 chosen) drafted nothing. The prefill pass (i = 0): the head drafts
    from the target's features, which that pass computes (no_proposal). A verification pass: the executor asked the
    head for min(k, max_draft_len, tokens left - 1) drafts (Executor._fused_round); none asked means one token was
    left (last_token), else the head gave its first draft less than speculative.draft_p_min (draft_p_min), or with
    policy cost its first draft did not pay for its row (policy; engine/draft_cost.py)."""
    if i == 0:
        return REASON_NO_PROPOSAL if drafted_rounds else REASON_LAST_TOKEN
    asked = min(k, max_draft_len, max_tokens - sum(emitted[:i]) - 1)
    if asked <= 0:
        return REASON_LAST_TOKEN
    return REASON_POLICY if policy == "cost" else REASON_DRAFT_P_MIN


class BlsOps:
    """What tensorrt_llm_bls does for metrics and the canary, behind a few calls (see that file).

    `control_percent` (BLS parameter `canary_control_percent`, env CANARY_ENV overrides) of the requests
    that do not set `num_draft_tokens` go down the plain path and are labelled arm=control.
    """

    def __init__(
        self,
        sink: Sink,
        model: str,
        max_draft_len: int,
        control_percent: float = 0.0,
        seed: int | None = None,
        clock=time.time,
    ):
        import os
        import random

        override = os.environ.get(CANARY_ENV)
        self.control_percent = float(override) if override not in (None, "") else float(control_percent)
        self.recorder = Recorder(sink, model, max_draft_len, clock=clock)
        self.rng = random.Random(seed)
        self.clock = clock

    @classmethod
    def in_triton(cls, pb_utils, model: str, max_draft_len: int, params: Mapping[str, str]) -> "BlsOps":
        ops = cls(TritonSink(pb_utils), model, max_draft_len, float(params.get("canary_control_percent") or 0.0))
        ops.recorder.declare_all()
        return ops

    def start(self, requested_k: bool) -> RequestTimer:
        """A request arrives: pick its arm (requests that set num_draft_tokens stay speculative)."""
        control = not requested_k and self.control_percent > 0 and self.rng.random() * 100.0 < self.control_percent
        timer = self.recorder.request_started(CONTROL_ARM if control else SPECULATIVE_ARM)
        timer.requested_k = requested_k
        return timer

    def num_draft_tokens(self, timer: RequestTimer, k: int) -> int:
        return 0 if timer.arm == CONTROL_ARM else k

    def verifier(self, timer: RequestTimer, verifier, max_tokens: int, prompt_len: int):
        return PlainVerifier(verifier, max_tokens, prompt_len) if timer.arm == CONTROL_ARM else verifier

    def policy(self, timer: RequestTimer, inner, deployment=None) -> MeteredPolicy:
        """The request's policy, metered; on the control arm none (its one long call must not teach the
        speculation policy's cost model what a plain step costs)."""
        if timer.arm == CONTROL_ARM:
            return MeteredPolicy(None, self.recorder, timer, None, REASON_CONTROL_ARM)
        return MeteredPolicy(inner, self.recorder, timer, deployment)

    def fused_k(self, timer: RequestTimer, requested: int, cap: int, inner, deployment) -> tuple[int, str | None]:
        """(k, why it is 0) for a fused EAGLE-3 call: `requested` drafts (0 on the canary's control arm), capped at
        `cap` and by the policy (`inner`: the static policy's schedule and gate). The reason is None when k > 0."""
        metered = self.policy(timer, inner, deployment)
        k = self.num_draft_tokens(timer, requested)
        if k <= 0:
            return 0, metered.forced_reason or REASON_NO_DRAFT
        k = metered.choose(min(k, cap))
        return k, (metered.reason if k == 0 else None)

    def fused_rounds(
        self,
        timer: RequestTimer,
        k: int,
        max_draft_len: int,
        max_tokens: int,
        drafted_rounds: list[int],
        accepted_rounds: list[int],
        n_tokens: int,
        call_s: float,
        plain_reason: str | None,
        policy: str = "static",
        lookup_rounds: list[int] | None = None,
        pass_s: list[float] | None = None,
        draft_s: list[float] | None = None,
    ) -> FusedRounds:
        """One metrics round per target pass of a fused EAGLE-3 call (the head drafts inside the target's model): the
        prefill pass, then each verification pass with its drafted / accepted counts (`drafted_rounds`,
        `accepted_rounds`: the executor's per-pass lists; empty: the request ran plain, one round). `k`: the draft
        count the request asked for (0: plain, with `plain_reason`). `policy`: speculative.policy (with cost, a
        verification pass without drafts is counted under reason policy). `lookup_rounds`: beside drafted_rounds, 1
        where the pass's drafts were the suffix lookup's (lookup series). Seconds: `pass_s`, every engine pass, the
        prefill first, and `draft_s`, the head's work before each verification pass, where the model returns them
        (a call with verification passes); else the call's time (`call_s`) split evenly over its passes."""
        k_rounds = [0] + drafted_rounds if drafted_rounds else [0]
        a_rounds = [0] + accepted_rounds if drafted_rounds else [0]
        emitted = [a + 1 for a in a_rounds] if drafted_rounds else [n_tokens]
        if (
            drafted_rounds
        ):  # the last pass may have stopped early (end id, stop word, length): emitted sums to the output
            emitted[-1] = max(0, n_tokens - sum(emitted[:-1]))
        timed = (
            bool(drafted_rounds) and len(pass_s or ()) == len(k_rounds) and len(draft_s or ()) == len(drafted_rounds)
        )
        target_rounds = [float(t) for t in pass_s] if timed else [call_s / len(k_rounds)] * len(k_rounds)
        draft_rounds = [0.0] + [float(t) for t in draft_s] if timed else [0.0] * len(k_rounds)
        looked = [0] + list(lookup_rounds or []) if drafted_rounds else [0]
        looked += [0] * (len(k_rounds) - len(looked))
        for i, (kr, ar, er) in enumerate(zip(k_rounds, a_rounds, emitted)):
            reason = (
                None
                if kr
                else (
                    plain_reason
                    or _fused_plain_reason(i, k, max_draft_len, max_tokens, emitted, drafted_rounds, policy)
                )
            )
            self.recorder.round(
                timer.arm, kr, ar, er, draft_rounds[i], target_rounds[i], reason, lookup=bool(looked[i])
            )
        return FusedRounds(k_rounds, a_rounds, draft_rounds if timed else [], target_rounds if timed else [])

    def tokens(self, timer: RequestTimer | None, n: int) -> None:
        if timer is not None:
            timer.tokens(n, self.clock())

    def finish(self, timer: RequestTimer | None, prompt_tokens: int, ok: bool) -> None:
        if timer is not None:
            self.recorder.request_finished(timer, prompt_tokens, ok)

    def close(self) -> None:
        """At the model's `finalize` (TritonSink.close)."""
        self.recorder.sink.close()
