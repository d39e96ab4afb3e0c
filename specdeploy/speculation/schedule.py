"""TensorRT-LLM's pieces of the speculation policy, with its semantics and names: the draft-length schedule
(`draft_len_schedule`, keys are upper bounds on the active count) and the acceptance gate (`SpeculationGate`).
`specdeploy.speculation.policy` applies them to both of its policies.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Mapping


def scheduled_draft_len(schedule: Mapping[int, int | None] | None, active: int, default: int) -> int:
    """Draft length for `active` sequences under TensorRT-LLM's `draft_len_schedule` (upper bounds).

    {2: 4, 4: 2}: 1-2 active -> 4, 3-4 -> 2, 5 or more -> 0 (off). No schedule, or a bound whose length is None
    (max_concurrency's): `default`, the request's own.
    """
    if not schedule:
        return default
    keys = sorted(schedule)
    i = bisect_left(keys, max(1, active))  # the smallest key >= active
    if i == len(keys):
        return 0
    length = schedule[keys[i]]
    return default if length is None else length


def schedule_from(
    draft_len_schedule: Mapping[int, int] | None, max_concurrency: int | None
) -> dict[int, int | None] | None:
    """The effective schedule: the explicit one, or max_concurrency's, or None.

    max_concurrency N is {N: None}: up to N active a request drafts its own k, above N none. TensorRT-LLM's
    `max_concurrency` turns speculation off above N and shortens nothing below it ("speculation will be disabled at
    batch sizes above this value", DecodingBaseConfig in llm_args.py; gpu/llmapi_versions.py), so a request that asks
    for more than speculative.num_draft_tokens (up to the engine's max_draft_len: validate's draft-length sweep) gets
    it.
    """
    if draft_len_schedule:
        return dict(draft_len_schedule)
    if max_concurrency is not None:
        return {max_concurrency: None}
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
