"""The plain-Python latency histograms against the OpenTelemetry SDK's own: the same
samples give the same Prometheus series through OpenTelemetry's exporter."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.histograms import (
    HistogramSpec,
    PrometheusReaderWithHistograms,
    TierHistograms,
)

SPECS = (
    HistogramSpec("tiergate.ttft", "ms", "Time to first token", (5, 10, 25, 50, 100)),
    HistogramSpec("tiergate.tpot", "ms", "Time per output token", (1, 2.5, 10)),
)
RESOURCE = Resource.create({"service.name": "tiergate-test"})

samples_strategy = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=len(SPECS) - 1),
        st.sampled_from(["priority", "interactive", "batch"]),
        st.one_of(
            st.sampled_from([0.0, 1.0, 2.5, 5.0, 10.0, 100.0]),  # on the boundaries
            st.floats(min_value=0, max_value=1e6, allow_nan=False),
        ),
    ),
    max_size=60,
)


def _series(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("tiergate_"):
                out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _sdk_exposition(samples) -> str:
    registry = CollectorRegistry(auto_describe=False)
    reader = PrometheusMetricReader(registry=registry, scope_info_enabled=False)
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    meter = provider.get_meter("tiergate.gateway")
    meter.create_counter("tiergate.other").add(1)
    instruments = [
        meter.create_histogram(
            s.name,
            unit=s.unit,
            description=s.description,
            explicit_bucket_boundaries_advisory=s.bounds,
        )
        for s in SPECS
    ]
    for index, tier, value in samples:
        instruments[index].record(value, {"tier": tier})
    try:
        return generate_latest(registry).decode()
    finally:
        provider.shutdown()


def _ours_exposition(samples) -> str:
    registry = CollectorRegistry(auto_describe=False)
    histograms = TierHistograms(SPECS)
    reader = PrometheusReaderWithHistograms(
        histograms,
        RESOURCE,
        InstrumentationScope("tiergate.gateway"),
        registry=registry,
        scope_info_enabled=False,
    )
    provider = MeterProvider(metric_readers=[reader], resource=RESOURCE)
    # The gateway's meter always has instruments of its own (counters, gauges); the SDK
    # hands the reader nothing to add to while it has none.
    provider.get_meter("tiergate.gateway").create_counter("tiergate.other").add(1)
    for index, tier, value in samples:
        histograms.record(index, tier, value)
    try:
        return generate_latest(registry).decode()
    finally:
        provider.shutdown()


@given(samples_strategy)
@settings(max_examples=60, deadline=None)
def test_exposition_matches_the_sdk_histograms(samples) -> None:
    assert _series(_ours_exposition(samples)) == _series(_sdk_exposition(samples))


def test_names_units_and_buckets_are_the_sdks() -> None:
    text = _ours_exposition([(0, "interactive", 7.0), (0, "interactive", 10.0), (1, "batch", 3.0)])
    series = _series(text)
    bucket = "tiergate_ttft_milliseconds_bucket"
    assert series[(bucket, frozenset({("tier", "interactive"), ("le", "5")}))] == 0
    assert series[(bucket, frozenset({("tier", "interactive"), ("le", "10")}))] == 2
    assert series[("tiergate_ttft_milliseconds_count", frozenset({("tier", "interactive")}))] == 2
    assert series[("tiergate_tpot_milliseconds_sum", frozenset({("tier", "batch")}))] == 3.0
    assert "# HELP tiergate_ttft_milliseconds Time to first token" in text
