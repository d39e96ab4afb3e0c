"""Reading the metrics endpoint: `parse` turns the text exposition into a `Snapshot`, `Snapshot.minus` gives a
window, `arm_stats` the figures per arm (`monitor`, `canary` and `validate` use it). No HTTP import beyond urllib."""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from specdeploy.core.errors import ClientError
from specdeploy.core.metrics.names import (
    ACCEPTED_PER_POS,
    ACCEPTED_TOKENS,
    DRAFT_SECONDS,
    DRAFT_TOKENS,
    DRAFT_TOKENS_PER_POS,
    E2E,
    GENERATION_TOKENS,
    LOOKUP_ACCEPTED_TOKENS,
    LOOKUP_DRAFT_TOKENS,
    LOOKUP_DRAFTS,
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
    MetricDef,
)


@dataclass(frozen=True)
class Snapshot:
    """Samples of one scrape: {(sample name, sorted label pairs): value}, and when it was taken."""

    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
    taken_s: float = 0.0
    counters: frozenset = (
        frozenset()
    )  # families the exposition declared `# TYPE name counter` (Triton's nv_* lack _total)
    gauges: frozenset = frozenset()  # families it declared gauges: never cumulative, whatever their suffix (*_count)

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

    def _cumulative(self, name: str) -> bool:
        """A counter or a histogram's series (declared, else by its suffix); a declared gauge never is (Triton's
        nv_inference_pending_request_count ends in _count and goes down whenever the queue does)."""
        return name in self.counters or (
            name not in self.gauges and name.endswith(("_total", "_bucket", "_sum", "_count"))
        )

    def minus(self, earlier: "Snapshot") -> "Snapshot":
        """The window between two scrapes: counters and histogram series subtract; gauges keep the later value. A series
        that went down was reset (the server restarted): its later value is the window's, as Prometheus's increase()
        takes it; `resets` says whether that happened."""
        out = {}
        for key, value in self.samples.items():
            if self._cumulative(key[0]):
                before = earlier.samples.get(key, 0.0)
                value = value - before if value >= before else value
            out[key] = value
        return Snapshot(out, self.taken_s, self.counters, self.gauges)

    def resets(self, earlier: "Snapshot") -> list[str]:
        """The cumulative series lower now than in `earlier` (or gone): the server restarted between the two scrapes."""
        return sorted(
            {
                key[0]
                for key, before in earlier.samples.items()
                if self._cumulative(key[0]) and before > 0 and self.samples.get(key, 0.0) < before
            }
        )

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
    counters, gauges = set(), set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4 and parts[3] == "counter":
                counters.add(parts[2])
            elif len(parts) >= 4 and parts[3] == "gauge":
                gauges.add(parts[2])
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ClientError(
                f"the metrics endpoint returned text that is not Prometheus format (line {number}: {line[:80]!r})",
                "check --url points at Triton's metrics port (/metrics)",
            )
        name, label_text, value_text = match.groups()
        labels = []
        rest = label_text or ""
        while rest.strip():
            lm = _LABEL.match(rest)
            if lm is None:
                raise ClientError(
                    f"the metrics endpoint returned text that is not Prometheus format (labels on line {number})",
                    "check --url points at Triton's metrics port (/metrics)",
                )
            value = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            labels.append((lm.group(1), value))
            rest = rest[lm.end() :]
        try:
            value = float(value_text)
        except ValueError:
            raise ClientError(f"metrics line {number} has value {value_text!r}, not a number", "check --url") from None
        if name.endswith("_created"):
            continue
        key = (name, tuple(sorted(labels)))
        samples[key] = samples.get(key, 0.0) + value
    return Snapshot(samples, time.time() if taken_s is None else taken_s, frozenset(counters), frozenset(gauges))


def metrics_url(url: str) -> str:
    """host:port, http://host:port or a full /metrics URL -> the /metrics URL."""
    if "://" not in url:
        url = "http://" + url
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def fetch(url: str, timeout_s: float, hint: str, what: str = "metrics") -> str:
    """The text of the metrics endpoint `url` names (metrics_url); a ClientError that names `what` it could not read,
    with `hint`."""
    full = metrics_url(url)
    try:
        with urllib.request.urlopen(full, timeout=timeout_s) as response:
            return response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise ClientError(f"cannot read {what} from {full}: {exc}", hint) from exc


def scrape(url: str, timeout_s: float = 5.0) -> Snapshot:
    """GET the metrics endpoint and parse it; ClientError when it cannot be read."""
    hint = "start the server (specdeploy serve RECIPE --detach) or pass --url host:metrics_port"
    return parse(fetch(url, timeout_s, hint))


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
    # EAGLE-3 with draft.sa_config: of the drafting rounds / drafts / accepted drafts, the suffix lookup's
    lookup_rounds: float = 0.0
    lookup_drafted: float = 0.0
    lookup_accepted: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_round(self) -> float | None:
        """Output tokens per target pass (the acceptance length)."""
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
        accepted_per_pos={
            int(k): v for k, v in snapshot.by_label(ACCEPTED_PER_POS.name, "position", **match).items() if k and v
        },
        drafted_per_pos={
            int(k): v for k, v in snapshot.by_label(DRAFT_TOKENS_PER_POS.name, "position", **match).items() if k and v
        },
        lookup_rounds=snapshot.sum(LOOKUP_DRAFTS.name, **match),
        lookup_drafted=snapshot.sum(LOOKUP_DRAFT_TOKENS.name, **match),
        lookup_accepted=snapshot.sum(LOOKUP_ACCEPTED_TOKENS.name, **match),
    )


def count_mismatches(
    window: Snapshot, arm: str = SPECULATIVE_ARM, model: str | None = None, **expected: float
) -> list[str]:
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
