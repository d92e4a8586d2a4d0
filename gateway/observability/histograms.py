"""The per-tier latency histograms, aggregated in plain Python and exported by
OpenTelemetry's Prometheus exporter.

A record on an OpenTelemetry SDK histogram goes through its measurement pipeline (a
measurement object, attribute hashing, view matching, a lock): ~12 µs here, and the
gateway records four per request, on the one thread that serves every request. These
four are aggregated here instead (a bisect and a few additions) with the SDK's bucket
rule, and at every collection their cumulative state joins the SDK's own metrics as
OpenTelemetry `HistogramDataPoint`s, so the Prometheus text is still written by
OpenTelemetry's exporter, with the names, units and buckets the SDK would give them.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope


@dataclass(frozen=True)
class HistogramSpec:
    name: str  # OpenTelemetry instrument name, e.g. "tiergate.ttft"
    unit: str
    description: str
    bounds: tuple[float, ...]  # explicit bucket boundaries, increasing


class _Series:
    __slots__ = ("count", "counts", "max", "min", "start_ns", "sum")

    def __init__(self, num_buckets: int) -> None:
        self.counts = [0] * num_buckets
        self.count = 0
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")
        self.start_ns = time.time_ns()


class TierHistograms:
    """Cumulative histograms of `specs`, one series per (histogram, tier)."""

    def __init__(self, specs: Sequence[HistogramSpec]) -> None:
        self.specs = tuple(specs)
        self._series: list[dict[str, _Series]] = [{} for _ in self.specs]
        self._lock = threading.Lock()  # a scrape may read from another thread

    def record(self, index: int, tier: str, value: float) -> None:
        """Count `value` in histogram `self.specs[index]` for `tier`."""
        spec = self.specs[index]
        with self._lock:
            series = self._series[index].get(tier)
            if series is None:
                series = self._series[index][tier] = _Series(len(spec.bounds) + 1)
            # As the SDK buckets: a value equal to a boundary counts in the bucket below.
            series.counts[bisect.bisect_left(spec.bounds, value)] += 1
            series.count += 1
            series.sum += value
            if value < series.min:
                series.min = value
            if value > series.max:
                series.max = value

    def metrics(self) -> list[Metric]:
        """The histograms as OpenTelemetry metrics (cumulative), for a collection."""
        now_ns = time.time_ns()
        out = []
        with self._lock:
            for spec, by_tier in zip(self.specs, self._series, strict=True):
                if not by_tier:
                    continue
                points = [
                    HistogramDataPoint(
                        attributes={"tier": tier},
                        start_time_unix_nano=s.start_ns,
                        time_unix_nano=now_ns,
                        count=s.count,
                        sum=s.sum,
                        bucket_counts=list(s.counts),
                        explicit_bounds=list(spec.bounds),
                        min=s.min,
                        max=s.max,
                    )
                    for tier, s in sorted(by_tier.items())
                ]
                data = Histogram(points, AggregationTemporality.CUMULATIVE)
                out.append(Metric(spec.name, spec.description, spec.unit, data))
        return out


class PrometheusReaderWithHistograms(PrometheusMetricReader):
    """OpenTelemetry's Prometheus reader, which adds `histograms` to what it collects."""

    def __init__(
        self,
        histograms: TierHistograms,
        resource: Resource,
        scope: InstrumentationScope,
        **kwargs: Any,
    ) -> None:
        self._histograms = histograms
        self._resource = resource
        self._scope = scope
        super().__init__(**kwargs)

    def _receive_metrics(
        self, metrics_data: MetricsData | None, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        extra = ScopeMetrics(self._scope, self._histograms.metrics(), "")
        if metrics_data is None or not metrics_data.resource_metrics:
            metrics_data = MetricsData([ResourceMetrics(self._resource, [extra], "")])
        else:
            first, *rest = metrics_data.resource_metrics
            first = ResourceMetrics(first.resource, [*first.scope_metrics, extra], first.schema_url)
            metrics_data = MetricsData([first, *rest])
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)
