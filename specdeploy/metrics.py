"""Prometheus metrics of a deployment: the names, the recorder the BLS writes through, and the reader
that `monitor`, `canary` and `validate` use on Triton's metrics endpoint.

Names follow vLLM (`vllm:spec_decode_num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos{position}`, `..._num_drafts`, `e2e_request_latency_seconds`,
`time_to_first_token_seconds`, `time_per_output_token_seconds`, `generation_tokens_total`,
`num_requests_running`) and `trtllm-serve` (`trtllm_spec_decode_num_draft_tokens_total`,
`..._acceptance_length`), with our own prefix `specdeploy_` so a dashboard or PromQL written for them
carries over by swapping the prefix. Every series has the labels `model` (the Triton model that
served it) and `arm` (`speculative`, or `control` for the share a canary sends down the plain path).

Writing: `Recorder` turns request/round events into counter increments, gauge moves and histogram
observations on a `Sink`: `TritonSink` inside the python backend (`pb_utils.MetricFamily`, exported
on Triton's metrics port), `PrometheusClientSink` elsewhere (a prometheus_client registry).
Reading: `parse` turns the text exposition into a `Snapshot`; `Snapshot.minus` gives a window;
`arm_stats` the figures per arm. No Triton or HTTP import at module level.
"""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence

from specdeploy.errors import ClientError

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
E2E = _m("e2e_request_latency_seconds", "histogram", "End-to-end request latency in the server.", buckets=LATENCY_BUCKETS)
TTFT = _m("time_to_first_token_seconds", "histogram", "Time to the first output token in the server.", buckets=LATENCY_BUCKETS)
TPOT = _m("time_per_output_token_seconds", "histogram", "(latency - TTFT) / (output tokens - 1) per request.", buckets=TPOT_BUCKETS)
DRAFTS = _m("spec_decode_num_drafts_total", "counter", "Rounds in which the draft proposed tokens (vLLM num_drafts).")
DRAFT_TOKENS = _m("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.")
ACCEPTED_TOKENS = _m("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens the target accepted.")
DRAFT_TOKENS_PER_POS = _m(
    "spec_decode_num_draft_tokens_per_pos_total", "counter", "Draft tokens proposed at each draft position (0-based).", ("model", "arm", "position")
)
ACCEPTED_PER_POS = _m(
    "spec_decode_num_accepted_tokens_per_pos_total", "counter", "Draft tokens accepted at each draft position (0-based).", ("model", "arm", "position")
)
TARGET_PASSES = _m("spec_decode_num_target_passes_total", "counter", "Target forward calls (verification passes; the plain path's one call counts once).")
ACCEPTANCE_LENGTH = _m(
    "spec_decode_acceptance_length", "histogram", "Tokens emitted per target pass in a round (accepted drafts + 1).", buckets=()
)  # buckets 1..max_draft_len+1, set by the Recorder
DRAFT_SECONDS = _m("spec_decode_draft_seconds_total", "counter", "Time spent in draft calls.")
TARGET_SECONDS = _m("spec_decode_target_seconds_total", "counter", "Time spent in target calls.")
ROUNDS = _m(
    "spec_decode_rounds_total", "counter", "Rounds with speculation on or off, and why it was off.", ("model", "arm", "speculation", "reason")
)
ALL_METRICS = (
    REQUESTS, REQUEST_ERRORS, PROMPT_TOKENS, GENERATION_TOKENS, RUNNING, E2E, TTFT, TPOT, DRAFTS, DRAFT_TOKENS,
    ACCEPTED_TOKENS, DRAFT_TOKENS_PER_POS, ACCEPTED_PER_POS, TARGET_PASSES, ACCEPTANCE_LENGTH, DRAFT_SECONDS,
    TARGET_SECONDS, ROUNDS,
)  # fmt: skip
SPEC_ON, SPEC_OFF = "on", "off"
REASON_NONE = "none"  # speculation was on
REASON_LAST_TOKEN = "last_token"  # one token left: nothing to draft
REASON_CONTROL_ARM = "control_arm"  # the canary sent this request down the plain path


# ---------------------------------------------------------------- writing


class Sink(Protocol):
    """Where metric updates go (a Triton MetricFamily registry, a prometheus_client registry, ...)."""

    def add(self, metric: MetricDef, labels: Mapping[str, str], value: float) -> None:
        """Counter increment, or gauge move (value may be negative for a gauge)."""

    def observe(self, metric: MetricDef, labels: Mapping[str, str], value: float, buckets: Sequence[float]) -> None: ...

    def declare(self, metric: MetricDef, labels: Mapping[str, str], buckets: Sequence[float] = ()) -> None:
        """Create the series (at zero) without changing it."""

    def close(self) -> None:
        """The model is finalized: release what must not outlive it."""


class TritonSink:
    """Triton python-backend custom metrics (`pb_utils.MetricFamily`, Triton >= 2.51 for histograms).

    Families and metrics are created on first use and kept referenced: Triton drops a metric from the
    endpoint when its Python object goes away.
    """

    def __init__(self, pb_utils):
        self.pb = pb_utils
        self.error: str | None = None
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, object] = {}

    def _metric(self, metric: MetricDef, labels: Mapping[str, str], buckets: Sequence[float] = ()):
        key = (metric.name, tuple(sorted(labels.items())))
        found = self._metrics.get(key)
        if found is None:
            family = self._families.get(metric.name)
            if family is None:
                kind = {"counter": self.pb.MetricFamily.COUNTER, "gauge": self.pb.MetricFamily.GAUGE,
                        "histogram": self.pb.MetricFamily.HISTOGRAM}[metric.kind]  # fmt: skip
                family = self.pb.MetricFamily(name=metric.name, description=metric.help, kind=kind)
                self._families[metric.name] = family
            kwargs = {"buckets": [float(b) for b in buckets]} if metric.kind == "histogram" else {}
            found = self._metrics[key] = family.Metric(labels=dict(labels), **kwargs)
        return found

    def add(self, metric, labels, value):
        if value:
            self._guarded(lambda: self._metric(metric, labels).increment(float(value)))

    def observe(self, metric, labels, value, buckets):
        self._guarded(lambda: self._metric(metric, labels, buckets).observe(float(value)))

    def declare(self, metric, labels, buckets=()):
        self._guarded(lambda: self._metric(metric, labels, buckets))

    def close(self) -> None:
        """Release the metrics and families now, from the model's `finalize`, while the stub can still tell the
        server: one released later, at the stub's teardown, writes to the stub's shared memory after it is gone
        (SIGSEGV in `Metric::SaveToSharedMemory` under `MetricFamily::~MetricFamily`, tritonserver 2.51). Fixed
        upstream by triton-inference-server/python_backend#429 (`Stub::DestroyPythonObjects` before `~Stub`)."""
        self._metrics.clear()
        self._families.clear()
        self.error = "closed"  # no series is created again

    def _guarded(self, update) -> None:
        """Metrics never fail a request: the first error is logged and metrics stop for this instance."""
        if self.error is not None:
            return
        try:
            update()
        except Exception as exc:  # noqa: BLE001 - any stub/core error; serving goes on
            import sys

            self.error = f"{type(exc).__name__}: {exc}"
            print(f"specdeploy metrics disabled in this model instance: {self.error}", file=sys.stderr, flush=True)


class PrometheusClientSink:
    """The same metrics in a prometheus_client registry (tests, and any in-process server)."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry

        self.registry = registry if registry is not None else CollectorRegistry()
        self._collectors: dict[str, object] = {}

    def _collector(self, metric: MetricDef, buckets: Sequence[float] = ()):
        from prometheus_client import Counter, Gauge, Histogram

        c = self._collectors.get(metric.name)
        if c is None:
            if metric.kind == "counter":
                c = Counter(metric.name, metric.help, list(metric.labels), registry=self.registry)
            elif metric.kind == "gauge":
                c = Gauge(metric.name, metric.help, list(metric.labels), registry=self.registry)
            else:
                c = Histogram(metric.name, metric.help, list(metric.labels), buckets=list(buckets), registry=self.registry)
            self._collectors[metric.name] = c
        return c

    def add(self, metric, labels, value):
        child = self._collector(metric).labels(**labels)
        if metric.kind == "counter":
            child.inc(value)
        else:
            child.inc(value)  # a gauge moves both ways

    def observe(self, metric, labels, value, buckets):
        self._collector(metric, buckets).labels(**labels).observe(value)

    def declare(self, metric, labels, buckets=()):
        self._collector(metric, buckets).labels(**labels)

    def close(self) -> None:
        pass  # the registry is the caller's

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


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
            for metric in (REQUESTS, REQUEST_ERRORS, PROMPT_TOKENS, GENERATION_TOKENS, RUNNING, DRAFTS, DRAFT_TOKENS,
                           ACCEPTED_TOKENS, TARGET_PASSES, DRAFT_SECONDS, TARGET_SECONDS):  # fmt: skip
                self.sink.declare(metric, self._labels(arm))
            for metric in (E2E, TTFT, TPOT):
                self.sink.declare(metric, self._labels(arm), metric.buckets)
            self.sink.declare(ACCEPTANCE_LENGTH, self._labels(arm), self.length_buckets)
            for pos in range(self.max_draft_len):
                self.sink.declare(DRAFT_TOKENS_PER_POS, self._labels(arm, position=pos))
                self.sink.declare(ACCEPTED_PER_POS, self._labels(arm, position=pos))
            self.sink.declare(ROUNDS, self._labels(arm, speculation=SPEC_ON, reason=REASON_NONE))
            for reason in (REASON_LAST_TOKEN, REASON_CONTROL_ARM, REASON_GATE, REASON_SCHEDULE, REASON_POLICY, REASON_NO_DRAFT,
                           REASON_NO_PROPOSAL):
                self.sink.declare(ROUNDS, self._labels(arm, speculation=SPEC_OFF, reason=reason))

    def request_started(self, arm: str) -> RequestTimer:
        assert arm in ARMS, arm
        self.sink.add(RUNNING, self._labels(arm), 1)
        return RequestTimer(arm, self.clock())

    def round(self, arm: str, drafted: int, accepted: int, emitted: int, draft_s: float, target_s: float, reason: str | None = None) -> None:
        """One target pass: `drafted` draft tokens proposed, `accepted` of them kept, `emitted` new tokens."""
        labels = self._labels(arm)
        on = drafted > 0
        self.sink.add(ROUNDS, self._labels(arm, speculation=SPEC_ON if on else SPEC_OFF, reason=REASON_NONE if on else (reason or REASON_LAST_TOKEN)), 1)
        self.sink.add(TARGET_PASSES, labels, 1)
        self.sink.add(TARGET_SECONDS, labels, target_s)
        if on:
            self.sink.add(DRAFTS, labels, 1)
            self.sink.add(DRAFT_TOKENS, labels, drafted)
            self.sink.add(ACCEPTED_TOKENS, labels, accepted)
            self.sink.add(DRAFT_SECONDS, labels, draft_s)
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


REASON_GATE = "gate"  # the acceptance gate turned speculation off (specdeploy.policy.AcceptanceGate)
REASON_SCHEDULE = "schedule"  # draft_len_schedule / max_concurrency: too many active sequences
REASON_POLICY = "policy"  # the cost policy predicted a plain step pays more
REASON_NO_DRAFT = "num_draft_tokens_0"  # the request asked for no draft tokens
REASON_NO_PROPOSAL = "no_proposal"  # the draft proposed nothing (an n-gram without a match)
CANARY_ENV = "SPECDEPLOY_CANARY_CONTROL_PERCENT"  # overrides the BLS parameter (the Kubernetes control Deployment sets 100)


class MeteredPolicy:
    """Wraps a specdeploy.policy RequestPolicy: one `Recorder.round` per round, with why speculation was off."""

    def __init__(self, inner, recorder: Recorder, timer: RequestTimer, deployment=None, forced_reason: str | None = None):
        self.inner, self.recorder, self.timer, self.deployment, self.forced_reason = inner, recorder, timer, deployment, forced_reason
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
        """The inner policy's plain run after k = 0 (specdeploy.policy); the control arm's PlainVerifier asks for the rest itself."""
        return self.inner.plain_tokens(remaining) if self.inner is not None and hasattr(self.inner, "plain_tokens") else 1

    def empty_run(self, remaining: int) -> int:
        """The inner policy's plain run after an empty proposal."""
        return self.inner.empty_run(remaining) if self.inner is not None and hasattr(self.inner, "empty_run") else 1

    def record(self, outcome) -> None:
        reason = self.reason or (REASON_NO_PROPOSAL if outcome.drafted == 0 else None)  # chose k > 0, drafted nothing
        self.recorder.round(self.timer.arm, outcome.drafted, outcome.accepted, outcome.emitted, outcome.draft_time_s,
                            outcome.target_time_s, reason)  # fmt: skip
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


class BlsOps:
    """What tensorrt_llm_bls does for metrics and the canary, behind a few calls (see that file).

    `control_percent` (BLS parameter `canary_control_percent`, env CANARY_ENV overrides) of the requests
    that do not set `num_draft_tokens` go down the plain path and are labelled arm=control.
    """

    def __init__(self, sink: Sink, model: str, max_draft_len: int, control_percent: float = 0.0, seed: int | None = None,
                 clock=time.time):  # fmt: skip
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

    def tokens(self, timer: RequestTimer | None, n: int) -> None:
        if timer is not None:
            timer.tokens(n, self.clock())

    def finish(self, timer: RequestTimer | None, prompt_tokens: int, ok: bool) -> None:
        if timer is not None:
            self.recorder.request_finished(timer, prompt_tokens, ok)

    def close(self) -> None:
        """At the model's `finalize` (TritonSink.close)."""
        self.recorder.sink.close()


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class Snapshot:
    """Samples of one scrape: {(sample name, sorted label pairs): value}, and when it was taken."""

    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
    taken_s: float = 0.0
    counters: frozenset = frozenset()  # families the exposition declared `# TYPE name counter` (Triton's nv_* lack _total)

    def sum(self, name: str, **match: str) -> float:
        """Sum of the samples named `name` whose labels include `match`."""
        total = 0.0
        for (sample, labels), value in self.samples.items():
            if sample == name and _matches(labels, match):
                total += value
        return total

    def by_label(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (sample, labels), value in self.samples.items():
            if sample == name and _matches(labels, match):
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + value
        return out

    def buckets(self, name: str, **match: str) -> list[tuple[float, float]]:
        """Cumulative (upper bound, count) of a histogram, summed over matching series, sorted."""
        counts = self.by_label(name + "_bucket", "le", **match)
        return sorted((float(le), c) for le, c in counts.items())

    def minus(self, earlier: "Snapshot") -> "Snapshot":
        """The window between two scrapes: counters and histogram series subtract; gauges keep the later value."""
        out = {}
        for key, value in self.samples.items():
            name = key[0]
            if name in self.counters or name.endswith(("_total", "_bucket", "_sum", "_count")):
                value = value - earlier.samples.get(key, 0.0)
            out[key] = value
        return Snapshot(out, self.taken_s, self.counters)

    def has(self, name: str) -> bool:
        return any(sample == name for sample, _ in self.samples)


def _matches(labels, match) -> bool:
    d = dict(labels)
    return all(d.get(k) == v for k, v in match.items())


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse(text: str, taken_s: float | None = None) -> Snapshot:
    """Prometheus text exposition (Triton's /metrics) -> Snapshot, sample names exactly as exported.

    (prometheus_client's parser renames counter samples to `<family>_total`, which would turn Triton's
    `nv_inference_request_success` into a name Triton never exports; hence this small reader.)
    """
    samples: dict = {}
    counters = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4 and parts[3] == "counter":
                counters.add(parts[2])
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ClientError(f"the metrics endpoint returned text that is not Prometheus format (line {number}: {line[:80]!r})",
                              "check --url points at Triton's metrics port (/metrics)")  # fmt: skip
        name, label_text, value_text = match.groups()
        labels = []
        rest = label_text or ""
        while rest.strip():
            lm = _LABEL.match(rest)
            if lm is None:
                raise ClientError(f"the metrics endpoint returned text that is not Prometheus format (labels on line {number})",
                                  "check --url points at Triton's metrics port (/metrics)")  # fmt: skip
            value = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            labels.append((lm.group(1), value))
            rest = rest[lm.end():]
        try:
            value = float(value_text)
        except ValueError:
            raise ClientError(f"metrics line {number} has value {value_text!r}, not a number", "check --url") from None
        if name.endswith("_created"):
            continue
        key = (name, tuple(sorted(labels)))
        samples[key] = samples.get(key, 0.0) + value
    return Snapshot(samples, time.time() if taken_s is None else taken_s, frozenset(counters))


def metrics_url(url: str) -> str:
    """host:port, http://host:port or a full /metrics URL -> the /metrics URL."""
    if "://" not in url:
        url = "http://" + url
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def scrape(url: str, timeout_s: float = 5.0) -> Snapshot:
    """GET the metrics endpoint and parse it; ClientError when it cannot be read."""
    full = metrics_url(url)
    try:
        with urllib.request.urlopen(full, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise ClientError(f"cannot read metrics from {full}: {exc}", "start the server (specdeploy serve RECIPE --detach) or pass --url host:metrics_port") from exc
    return parse(text)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket holding rank q * count.

    `buckets` are cumulative (upper bound, count) pairs sorted by bound, ending with +Inf. A rank in the
    +Inf bucket returns the largest finite bound (as Prometheus does). None when nothing was observed.
    """
    assert 0.0 <= q <= 1.0, q
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > prev_count:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = (bound if not math.isinf(bound) else prev_bound), count
    return prev_bound


@dataclass(frozen=True)
class ArmStats:
    """One arm's figures over a window (or since start when the snapshot is not a difference)."""

    arm: str
    requests: float
    errors: float
    output_tokens: float
    drafted: float
    accepted: float
    target_passes: float
    rounds_on: float
    rounds_off: float
    off_reasons: Mapping[str, float]
    running: float
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    ttft_p50_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_mean_s: float | None
    tpot_mean_s: float | None
    draft_s: float
    target_s: float
    accepted_per_pos: Mapping[int, float] = field(default_factory=dict)
    drafted_per_pos: Mapping[int, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_round(self) -> float | None:
        """Output tokens per target pass (DESIGN.md's acceptance length)."""
        return self.output_tokens / self.target_passes if self.target_passes else None

    def tokens_per_s(self, window_s: float) -> float | None:
        return self.output_tokens / window_s if window_s > 0 else None


def _mean(snapshot: Snapshot, metric: MetricDef, match) -> float | None:
    count = snapshot.sum(metric.name + "_count", **match)
    return snapshot.sum(metric.name + "_sum", **match) / count if count else None


def arm_stats(snapshot: Snapshot, arm: str, model: str | None = None) -> ArmStats:
    match = {"arm": arm, **({"model": model} if model else {})}
    rounds = snapshot.by_label(ROUNDS.name, "speculation", **match)
    reasons = {k: v for k, v in snapshot.by_label(ROUNDS.name, "reason", **match, speculation=SPEC_OFF).items() if v}
    q = lambda p, m: histogram_quantile(p, snapshot.buckets(m.name, **match))  # noqa: E731
    return ArmStats(
        arm=arm,
        requests=snapshot.sum(REQUESTS.name, **match),
        errors=snapshot.sum(REQUEST_ERRORS.name, **match),
        output_tokens=snapshot.sum(GENERATION_TOKENS.name, **match),
        drafted=snapshot.sum(DRAFT_TOKENS.name, **match),
        accepted=snapshot.sum(ACCEPTED_TOKENS.name, **match),
        target_passes=snapshot.sum(TARGET_PASSES.name, **match),
        rounds_on=rounds.get(SPEC_ON, 0.0),
        rounds_off=rounds.get(SPEC_OFF, 0.0),
        off_reasons=reasons,
        running=snapshot.sum(RUNNING.name, **match),
        e2e_p50_s=q(0.5, E2E),
        e2e_p99_s=q(0.99, E2E),
        ttft_p50_s=q(0.5, TTFT),
        tpot_p50_s=q(0.5, TPOT),
        tpot_p99_s=q(0.99, TPOT),
        e2e_mean_s=_mean(snapshot, E2E, match),
        tpot_mean_s=_mean(snapshot, TPOT, match),
        draft_s=snapshot.sum(DRAFT_SECONDS.name, **match),
        target_s=snapshot.sum(TARGET_SECONDS.name, **match),
        accepted_per_pos={int(k): v for k, v in snapshot.by_label(ACCEPTED_PER_POS.name, "position", **match).items() if k and v},
        drafted_per_pos={int(k): v for k, v in snapshot.by_label(DRAFT_TOKENS_PER_POS.name, "position", **match).items() if k and v},
    )


def count_mismatches(window: Snapshot, arm: str = SPECULATIVE_ARM, model: str | None = None, **expected: float) -> list[str]:
    """Where the endpoint's counts over a window differ from a client's own (`validate` after its run).

    expected keys: requests, errors, drafted, accepted, output_tokens, target_passes (any subset).
    Returns one line per mismatch; empty when they agree.
    """
    stats = arm_stats(window, arm, model)
    out = []
    for key, want in expected.items():
        got = getattr(stats, key)
        if abs(got - want) > 1e-6:
            out.append(f"{key}: metrics say {got:g}, the client counted {want:g} (arm {arm})")
    return out


def wait_for_change(url: str, baseline: Snapshot, name: str, timeout_s: float = 5.0, poll_s: float = 0.1) -> Snapshot:
    """Scrape until the sum of `name` differs from `baseline` (Triton refreshes some metrics lazily)."""
    deadline = time.monotonic() + timeout_s
    snap = scrape(url)
    while snap.sum(name) == baseline.sum(name) and time.monotonic() < deadline:
        time.sleep(poll_s)
        snap = scrape(url)
    return snap


def names(metrics: Iterable[MetricDef] = ALL_METRICS) -> list[str]:
    return [m.name for m in metrics]


# ---------------------------------------------------------------- Grafana


def grafana_dashboard(title: str, price_per_hour: float = 0.0, currency: str = "USD", rate_window: str = "5m") -> dict:
    """A Grafana dashboard (JSON model, Prometheus data source variable) over the metrics above, per arm."""

    def rate(metric: MetricDef, by: str = "arm", suffix: str = "") -> str:
        return f"sum by ({by}) (rate({metric.name}{suffix}{{job=~\"$job\"}}[{rate_window}]))"

    def quantile(q: float, metric: MetricDef) -> str:
        return f"histogram_quantile({q}, {rate(metric, 'le, arm', '_bucket')})"

    panels = [
        ("Acceptance rate (accepted / drafted)", f"{rate(ACCEPTED_TOKENS)} / {rate(DRAFT_TOKENS)}", "percentunit"),
        ("Tokens per target pass", f"{rate(GENERATION_TOKENS)} / {rate(TARGET_PASSES)}", "short"),
        ("Acceptance by draft position", f"{rate(ACCEPTED_PER_POS, 'position')} / {rate(DRAFT_TOKENS_PER_POS, 'position')}", "percentunit"),
        ("Output tokens/s", rate(GENERATION_TOKENS), "short"),
        ("TPOT p50", quantile(0.5, TPOT), "s"),
        ("TPOT p99", quantile(0.99, TPOT), "s"),
        ("End-to-end latency p50", quantile(0.5, E2E), "s"),
        ("End-to-end latency p99", quantile(0.99, E2E), "s"),
        ("Time to first token p50", quantile(0.5, TTFT), "s"),
        ("Requests running", f"sum by (arm) ({RUNNING.name}{{job=~\"$job\"}})", "short"),
        ("Requests/s (ok, failed)", f"{rate(REQUESTS)} or label_replace({rate(REQUEST_ERRORS)}, \"arm\", \"$1 failed\", \"arm\", \"(.*)\")", "reqps"),
        ("Rounds with speculation on/off (by reason)", rate(ROUNDS, "speculation, reason"), "short"),
        ("Draft time / target time", f"{rate(DRAFT_SECONDS)} / {rate(TARGET_SECONDS)}", "percentunit"),
    ]
    if price_per_hour > 0:
        pods = f"count(count by (pod) ({RUNNING.name}{{job=~\"$job\"}}))"
        panels.append((f"Cost per 1k output tokens ({currency}, {price_per_hour:g}/h per replica)",
                       f"{price_per_hour} / 3600 * 1000 * {pods} / sum(rate({GENERATION_TOKENS.name}{{job=~\"$job\"}}[{rate_window}]))",
                       "short"))  # fmt: skip
    out = []
    for i, (panel_title, expr, unit) in enumerate(panels):
        out.append({
            "id": i + 1,
            "type": "timeseries",
            "title": panel_title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": "A", "expr": expr, "legendFormat": "{{arm}}{{position}}{{speculation}} {{reason}}".strip()}],
        })  # fmt: skip
    return {
        "title": title,
        "uid": re.sub(r"[^a-zA-Z0-9-]", "-", title)[:40],
        "schemaVersion": 39,
        "tags": ["specdeploy", "speculative-decoding", "triton"],
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus"},
            {"name": "job", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": f"label_values({REQUESTS.name}, job)", "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}},
        ]},  # fmt: skip
        "panels": out,
    }
