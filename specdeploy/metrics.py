"""Prometheus metrics of a deployment: the names, the recorder the BLS writes through, and the reader
that `monitor`, `canary` and `validate` use on Triton's metrics endpoint.

Names follow vLLM (`vllm:spec_decode_num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos{position}`, `..._num_drafts`, `e2e_request_latency_seconds`,
`time_to_first_token_seconds`, `time_per_output_token_seconds`, `generation_tokens_total`,
`num_requests_running`) and `trtllm-serve` (`trtllm_spec_decode_num_draft_tokens_total`,
`..._acceptance_length`), with our own prefix `specdeploy_` so a dashboard or PromQL written for them
carries over by swapping the prefix. Every series has the labels `model` (the Triton model that
served it) and `arm` (`speculative`, or `control` for the share a canary sends down the plain path).

Writing (`metrics_recorder`, `metrics_sinks`): `Recorder` turns request/round events into counter increments,
gauge moves and histogram observations on a `Sink`: `TritonSink` inside the python backend (`pb_utils.MetricFamily`,
exported on Triton's metrics port), `PrometheusClientSink` elsewhere (a prometheus_client registry).
Reading (`metrics_reader`): `parse` turns the text exposition into a `Snapshot`; `Snapshot.minus` gives a window;
`arm_stats` the figures per arm. No Triton or HTTP import at module level.

The parts, one module each: `metric_names` (the table), `metrics_sinks`, `metrics_recorder` (with `BlsOps`, what the
BLS calls), `metrics_reader`, `metrics_dashboard` (Grafana). Every name stays importable from here: the python models
inside tritonserver, `monitor`, `canary` and the client import `specdeploy.metrics`.
"""

from __future__ import annotations

from specdeploy.metric_names import (  # noqa: F401
    ACCEPTANCE_LENGTH,
    ACCEPTED_PER_POS,
    ACCEPTED_TOKENS,
    ALL_METRICS,
    ARMS,
    CONTROL_ARM,
    DRAFTS,
    DRAFT_SECONDS,
    DRAFT_TOKENS,
    DRAFT_TOKENS_PER_POS,
    E2E,
    GENERATION_TOKENS,
    LATENCY_BUCKETS,
    LOOKUP_ACCEPTED_TOKENS,
    LOOKUP_DRAFT_TOKENS,
    LOOKUP_DRAFTS,
    PREFIX,
    PROMPT_TOKENS,
    REASON_CONTROL_ARM,
    REASON_DRAFT_P_MIN,
    REASON_GATE,
    REASON_LAST_TOKEN,
    REASON_NONE,
    REASON_NO_DRAFT,
    REASON_NO_PROPOSAL,
    REASON_POLICY,
    REASON_SCHEDULE,
    REQUESTS,
    REQUEST_ERRORS,
    ROUNDS,
    RUNNING,
    SECONDS_BUCKETS,
    SPECULATIVE_ARM,
    SPEC_OFF,
    SPEC_ON,
    TARGET_PASSES,
    TARGET_SECONDS,
    TPOT,
    TPOT_BUCKETS,
    TTFT,
    MetricDef,
    names,
)
from specdeploy.metrics_sinks import (  # noqa: F401
    PrometheusClientSink,
    Sink,
    TritonSink,
)
from specdeploy.metrics_recorder import (  # noqa: F401
    CANARY_ENV,
    BlsOps,
    MeteredPolicy,
    PlainVerifier,
    Recorder,
    RequestTimer,
)
from specdeploy.metrics_reader import (  # noqa: F401
    ArmStats,
    Snapshot,
    arm_stats,
    count_mismatches,
    histogram_quantile,
    metrics_url,
    parse,
    scrape,
    wait_for_change,
)
from specdeploy.metrics_dashboard import (  # noqa: F401
    grafana_dashboard,
)
