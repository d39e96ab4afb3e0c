"""Where metric updates go (`Sink`): `TritonSink` inside the python backend (`pb_utils.MetricFamily`, exported on
Triton's metrics port), `PrometheusClientSink` elsewhere (a prometheus_client registry)."""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from specdeploy.core.metrics.names import MetricDef


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
                kind = {
                    "counter": self.pb.MetricFamily.COUNTER,
                    "gauge": self.pb.MetricFamily.GAUGE,
                    "histogram": self.pb.MetricFamily.HISTOGRAM,
                }[metric.kind]
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
                c = Histogram(
                    metric.name, metric.help, list(metric.labels), buckets=list(buckets), registry=self.registry
                )
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
