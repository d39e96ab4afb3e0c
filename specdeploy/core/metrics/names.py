"""The metrics a deployment exports, written once: names, kinds, labels, buckets, and the reasons a round ran
without speculation (the dashboard, the recorder, the reader and the tests read this table)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

PREFIX = "specdeploy_"
SPECULATIVE_ARM, CONTROL_ARM = "speculative", "control"
ARMS = (SPECULATIVE_ARM, CONTROL_ARM)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
SECONDS_BUCKETS = LATENCY_BUCKETS


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ("model", "arm")
    buckets: tuple[float, ...] = ()


def _m(suffix, kind, help_, labels=("model", "arm"), buckets=()) -> MetricDef:
    return MetricDef(PREFIX + suffix, kind, help_, labels, tuple(buckets))


# Every metric the deployment exports, written once (the dashboard and the tests read this table).
REQUESTS = _m("request_success_total", "counter", "Requests finished without error, per arm.")
REQUEST_ERRORS = _m("request_failure_total", "counter", "Requests that ended in an error, per arm.")
PROMPT_TOKENS = _m("prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
GENERATION_TOKENS = _m("generation_tokens_total", "counter", "Output tokens of finished requests.")
RUNNING = _m("num_requests_running", "gauge", "Requests in flight.")
E2E = _m(
    "e2e_request_latency_seconds", "histogram", "End-to-end request latency in the server.", buckets=LATENCY_BUCKETS
)
TTFT = _m(
    "time_to_first_token_seconds", "histogram", "Time to the first output token in the server.", buckets=LATENCY_BUCKETS
)
TPOT = _m(
    "time_per_output_token_seconds",
    "histogram",
    "(latency - TTFT) / (output tokens - 1) per request.",
    buckets=TPOT_BUCKETS,
)
DRAFTS = _m("spec_decode_num_drafts_total", "counter", "Rounds in which the draft proposed tokens (vLLM num_drafts).")
DRAFT_TOKENS = _m("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.")
ACCEPTED_TOKENS = _m("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens the target accepted.")
DRAFT_TOKENS_PER_POS = _m(
    "spec_decode_num_draft_tokens_per_pos_total",
    "counter",
    "Draft tokens proposed at each draft position (0-based).",
    ("model", "arm", "position"),
)
ACCEPTED_PER_POS = _m(
    "spec_decode_num_accepted_tokens_per_pos_total",
    "counter",
    "Draft tokens accepted at each draft position (0-based).",
    ("model", "arm", "position"),
)
TARGET_PASSES = _m(
    "spec_decode_num_target_passes_total",
    "counter",
    "Target forward calls (verification passes; the plain path's one call counts once).",
)
ACCEPTANCE_LENGTH = _m(
    "spec_decode_acceptance_length",
    "histogram",
    "Tokens emitted per target pass in a round (accepted drafts + 1).",
    buckets=(),
)  # buckets 1..max_draft_len+1, set by the Recorder
LOOKUP_DRAFTS = _m(
    "spec_decode_num_lookup_drafts_total",
    "counter",
    "Of num_drafts, the rounds whose drafts were the request's own text (EAGLE-3 draft.sa_config), not the head's.",
)
LOOKUP_DRAFT_TOKENS = _m(
    "spec_decode_num_lookup_draft_tokens_total", "counter", "Of num_draft_tokens, those the suffix lookup drafted."
)
LOOKUP_ACCEPTED_TOKENS = _m(
    "spec_decode_num_lookup_accepted_tokens_total",
    "counter",
    "Of num_accepted_tokens, those the suffix lookup drafted.",
)
DRAFT_SECONDS = _m("spec_decode_draft_seconds_total", "counter", "Time spent in draft calls.")
TARGET_SECONDS = _m("spec_decode_target_seconds_total", "counter", "Time spent in target calls.")
ROUNDS = _m(
    "spec_decode_rounds_total",
    "counter",
    "Rounds with speculation on or off, and why it was off.",
    ("model", "arm", "speculation", "reason"),
)
ALL_METRICS = (
    REQUESTS,
    REQUEST_ERRORS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    RUNNING,
    E2E,
    TTFT,
    TPOT,
    DRAFTS,
    DRAFT_TOKENS,
    ACCEPTED_TOKENS,
    DRAFT_TOKENS_PER_POS,
    ACCEPTED_PER_POS,
    TARGET_PASSES,
    ACCEPTANCE_LENGTH,
    DRAFT_SECONDS,
    TARGET_SECONDS,
    ROUNDS,
    LOOKUP_DRAFTS,
    LOOKUP_DRAFT_TOKENS,
    LOOKUP_ACCEPTED_TOKENS,
)
SPEC_ON, SPEC_OFF = "on", "off"
REASON_NONE = "none"  # speculation was on
REASON_LAST_TOKEN = "last_token"  # one token left: nothing to draft
REASON_CONTROL_ARM = "control_arm"  # the canary sent this request down the plain path
REASON_GATE = "gate"  # the acceptance gate turned speculation off (specdeploy.speculation.schedule.AcceptanceGate)
REASON_SCHEDULE = "schedule"  # draft_len_schedule / max_concurrency: too many active sequences
REASON_POLICY = "policy"  # the cost policy predicted a plain step pays more
REASON_NO_DRAFT = "num_draft_tokens_0"  # the request asked for no draft tokens
REASON_NO_PROPOSAL = "no_proposal"  # the draft proposed nothing (an n-gram without a match)
REASON_DRAFT_P_MIN = "draft_p_min"  # the EAGLE-3 head gave its first draft less than speculative.draft_p_min


def names(metrics: Iterable[MetricDef] = ALL_METRICS) -> list[str]:
    return [m.name for m in metrics]
