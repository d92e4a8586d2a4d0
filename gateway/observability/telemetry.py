"""The process's telemetry: OpenTelemetry meters and tracer, and the live view.

One `Telemetry` per app, built by the composition root from `TelemetryConfig`; it owns
its own MeterProvider, TracerProvider and Prometheus registry (never the global ones),
so two apps in one process do not mix their numbers.

The request path reports each finished request once (`request_finished`); everything
else — queue depth, the engine's running/waiting sequences, KV utilisation, step token
budget, preemptions, recomputed tokens, tokens/s — is read when scraped, by observable
instruments over small probe functions the composition root hands in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability.config import TelemetryConfig
from gateway.observability.slo import RecentOutcomes, SloTargets, is_slo_met, tpot_ms
from gateway.observability.tenant_labels import TenantLabels
from gateway.observability.tracing import REQUEST_ID_ATTRIBUTE, RequestTimeline, record_phases

log = logging.getLogger(__name__)

LATENCY_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
TPOT_BUCKETS_MS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 200, 500, 1000)
SLO_WINDOW_S = 300.0  # the attainment gauge looks back this far

# Probes: () -> {tier: queued jobs}; () -> {worker id: engine stats}.
QueueProbe = Callable[[], Mapping[str, int]]
WorkerProbe = Callable[[], Mapping[str, Any]]


class FinishedRequest(Protocol):
    """What `request_finished` reads: the fields of gateway.usage.UsageRecord."""

    request_id: str
    tenant_id: str
    tier: str
    prompt_tokens: int
    completion_tokens: int
    queue_wait_ms: float | None
    ttft_ms: float | None
    e2e_ms: float
    outcome: str


class TierLike(Protocol):
    name: str
    rank: int
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None


class Telemetry:
    """Metrics, traces and the recent-outcomes window of one gateway process."""

    def __init__(self, config: TelemetryConfig | None = None) -> None:
        self.config = config or TelemetryConfig()
        self.registry = CollectorRegistry(auto_describe=False)
        self.tenant_labels = TenantLabels(self.config.top_tenants)
        self.recent = RecentOutcomes()
        self._slo_targets: dict[str, SloTargets] = {}
        self._tier_ranks: dict[str, int] = {}
        self._queue_probe: QueueProbe = dict
        self._worker_probe: WorkerProbe = dict
        self._open_spans: dict[str, Span] = {}
        self._propagator = TraceContextTextMapPropagator()
        self._meter_provider: MeterProvider | None = None
        self._tracer_provider: TracerProvider | None = None
        self.tracer: Tracer | None = None
        if self.config.is_enabled:
            self._build_metrics()
        if self.config.is_tracing:
            self._build_tracing()

    # ----------------------------------------------------------------- setup
    def _resource(self) -> Resource:
        return Resource.create({"service.name": self.config.service_name})

    def _build_metrics(self) -> None:
        reader = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
        self._meter_provider = MeterProvider(metric_readers=[reader], resource=self._resource())
        meter = self._meter_provider.get_meter("tiergate.gateway")
        self._requests = meter.create_counter(
            "tiergate.requests", unit="{request}", description="Requests by tier, tenant, outcome"
        )
        self._refusals = meter.create_counter(
            "tiergate.refusals", unit="{request}", description="Requests refused, by code"
        )
        self._slo = meter.create_counter(
            "tiergate.slo.requests",
            unit="{request}",
            description="Requests by tier and whether they met its SLO (refusals miss)",
        )
        self._tokens = meter.create_counter(
            "tiergate.tokens", unit="{token}", description="Tokens served, by tier and kind"
        )
        self._ttft = meter.create_histogram(
            "tiergate.ttft",
            unit="ms",
            description="Time to first token (arrival to first token)",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS,
        )
        self._tpot = meter.create_histogram(
            "tiergate.tpot",
            unit="ms",
            description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS_MS,
        )
        self._queue_wait = meter.create_histogram(
            "tiergate.queue_wait",
            unit="ms",
            description="Time queued before a worker took the request",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS,
        )
        self._e2e = meter.create_histogram(
            "tiergate.e2e",
            unit="ms",
            description="Arrival to last byte",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_MS,
        )
        meter.create_observable_gauge(
            "tiergate.slo.attainment",
            callbacks=[self._observe_attainment],
            unit="1",
            description=f"Share of a tier's requests within SLO, last {SLO_WINDOW_S:.0f} s",
        )
        meter.create_observable_gauge(
            "tiergate.queue.depth",
            callbacks=[self._observe_queue],
            unit="{request}",
            description="Requests queued, by tier",
        )
        worker_gauges = {
            "tiergate.engine.running": ("num_running", "{sequence}", "Running sequences"),
            "tiergate.engine.waiting": ("num_waiting", "{sequence}", "Waiting sequences"),
            "tiergate.engine.kv_cache.utilization": (
                "kv_cache_usage",
                "1",
                "Share of KV-cache blocks in use",
            ),
            "tiergate.engine.step_token_budget": (
                "step_token_budget",
                "{token}",
                "Tokens one engine step may batch",
            ),
        }
        for name, (field, unit, description) in worker_gauges.items():
            meter.create_observable_gauge(
                name, callbacks=[self._worker_callback(field)], unit=unit, description=description
            )
        meter.create_observable_counter(
            "tiergate.engine.preemptions",
            callbacks=[self._worker_callback("num_preemptions")],
            unit="{preemption}",
            description="Sequences preempted by the engine",
        )
        meter.create_observable_counter(
            "tiergate.engine.recomputed_tokens",
            callbacks=[self._worker_callback("num_recomputed_tokens")],
            unit="{token}",
            description="Tokens recomputed after preemption",
        )
        meter.create_observable_gauge(
            "tiergate.engine.token_rate",
            callbacks=[self._observe_tokens_per_s],
            unit="{token}/s",
            description="Engine throughput (smoothed), by phase",
        )

    def _build_tracing(self) -> None:
        exporter = self.config.span_exporter
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers etc. from OTEL_* variables
        self._tracer_provider = TracerProvider(resource=self._resource())
        self._tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._tracer_provider.get_tracer("tiergate.gateway")

    # ----------------------------------------------------------------- inputs
    def set_tiers(self, tiers: Iterable[TierLike]) -> None:
        """The tiers' current SLOs and ranks (the composition root keeps this fresh)."""
        tiers = list(tiers)
        self._slo_targets = {t.name: SloTargets(t.ttft_slo_ms, t.tpot_slo_ms) for t in tiers}
        self._tier_ranks = {t.name: t.rank for t in tiers}

    def watch_queue(self, probe: QueueProbe) -> None:
        self._queue_probe = probe

    def watch_workers(self, probe: WorkerProbe) -> None:
        self._worker_probe = probe

    # ----------------------------------------------------------------- requests
    def start_request(
        self, request_id: str, method: str, path: str, headers: Mapping[str, str]
    ) -> str | None:
        """Open the request's root span; returns its trace id (hex), None if not tracing."""
        if self.tracer is None:
            return None
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                REQUEST_ID_ATTRIBUTE: request_id,
                "http.request.method": method,
                "url.path": path,
            },
        )
        self._open_spans[request_id] = span
        return format(span.get_span_context().trace_id, "032x")

    def end_request(self, request_id: str, status_code: int | None) -> None:
        """Close the root span once the response is sent (or the connection dropped)."""
        span = self._open_spans.pop(request_id, None)
        if span is not None:
            if status_code is not None:
                span.set_attribute("http.response.status_code", status_code)
            span.end()

    def request_finished(
        self, record: FinishedRequest, timeline: RequestTimeline | None = None
    ) -> None:
        """Count one admitted-or-refused request: outcome, latencies, SLO, tokens, spans.

        Never raises: telemetry must not fail the request it describes.
        """
        try:
            self._request_finished(record, timeline)
        except Exception:
            log.exception("telemetry dropped request %s", getattr(record, "request_id", "?"))

    def _request_finished(self, record: FinishedRequest, timeline: RequestTimeline | None) -> None:
        outcome = record.outcome
        refusal_code = None
        if outcome.startswith("rejected"):
            refusal_code = outcome.partition(":")[2] or "unknown"
        is_ok = outcome == "ok"
        tpot = tpot_ms(record.e2e_ms, record.ttft_ms, record.completion_tokens)
        targets = self._slo_targets.get(record.tier, SloTargets())
        # A client that went away is neither a hit nor a miss: it did not wait for one.
        is_counted = outcome != "aborted"
        is_met = is_slo_met(targets, is_ok=is_ok, ttft_ms=record.ttft_ms, tpot_ms=tpot)
        if is_counted:
            self.recent.add(
                tier=record.tier,
                tenant_id=record.tenant_id,
                is_met=is_met,
                num_tokens=record.prompt_tokens + record.completion_tokens,
                refusal_code=refusal_code,
            )
        if self._meter_provider is not None:
            tier = {"tier": record.tier}
            tenant = self.tenant_labels.observe(record.tenant_id)
            kind = "rejected" if refusal_code is not None else outcome
            self._requests.add(1, {"tier": record.tier, "tenant": tenant, "outcome": kind})
            if refusal_code is not None:
                self._refusals.add(1, {"tier": record.tier, "code": refusal_code})
            if is_counted:
                self._slo.add(1, {"tier": record.tier, "met": "true" if is_met else "false"})
            if record.prompt_tokens and refusal_code is None:
                self._tokens.add(record.prompt_tokens, {**tier, "kind": "input"})
            if record.completion_tokens:
                self._tokens.add(record.completion_tokens, {**tier, "kind": "output"})
            if record.ttft_ms is not None:
                self._ttft.record(record.ttft_ms, tier)
            if tpot is not None:
                self._tpot.record(tpot, tier)
            if record.queue_wait_ms is not None:
                self._queue_wait.record(record.queue_wait_ms, tier)
            if refusal_code is None:
                self._e2e.record(record.e2e_ms, tier)
        if self.tracer is not None and timeline is not None:
            root = self._open_spans.get(record.request_id)
            if root is not None:
                root.set_attribute("tiergate.tier", record.tier)
                root.set_attribute("tiergate.tenant_id", record.tenant_id)
                record_phases(self.tracer, root, timeline, record.request_id, outcome)

    # ----------------------------------------------------------------- outputs
    def render_metrics(self) -> bytes:
        """The Prometheus text exposition of every metric (empty when disabled)."""
        if self._meter_provider is None:
            return b""
        return generate_latest(self.registry)

    def queue_depths(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in self._queue_probe().items()}
        except Exception:  # a probe must never break a scrape
            log.exception("queue depth probe failed")
            return {}

    def workers(self) -> dict[str, Any]:
        try:
            return dict(self._worker_probe())
        except Exception:
            log.exception("worker probe failed")
            return {}

    def snapshot(self, *, window_s: float = 600.0, num_tenants: int = 10) -> dict[str, Any]:
        """The live view the dashboard draws: queues, SLO series, refusals, workers."""
        now_s = time.time()
        depths = self.queue_depths()
        tiers = sorted(
            set(self._tier_ranks) | set(depths), key=lambda t: (self._tier_ranks.get(t, 99), t)
        )
        attainment = self.recent.attainment(SLO_WINDOW_S, now_s)
        return {
            "now_s": now_s,
            "bucket_s": self.recent.bucket_s,
            "tiers": [
                {
                    "name": name,
                    "rank": self._tier_ranks.get(name),
                    "queue_depth": depths.get(name, 0),
                    "slo_attainment": attainment.get(name),
                }
                for name in tiers
            ],
            "slo_series": self.recent.series(window_s, now_s),
            "refusals": self.recent.refusals(window_s, now_s),
            "top_tenants": self.recent.top_tenants(window_s, num_tenants, now_s),
            "workers": [
                {"id": worker_id, **_worker_view(stats)}
                for worker_id, stats in sorted(self.workers().items())
            ],
        }

    # ----------------------------------------------------------------- callbacks
    def _observe_attainment(self, _options: CallbackOptions) -> Iterable[Observation]:
        for tier, share in self.recent.attainment(SLO_WINDOW_S).items():
            yield Observation(share, {"tier": tier})

    def _observe_queue(self, _options: CallbackOptions) -> Iterable[Observation]:
        depths = self.queue_depths()
        for tier in set(self._tier_ranks) | set(depths):
            yield Observation(depths.get(tier, 0), {"tier": tier})

    def _worker_callback(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for worker_id, stats in self.workers().items():
                value = getattr(stats, field, None)
                if value is not None:
                    yield Observation(value, {"worker": worker_id})

        return observe

    def _observe_tokens_per_s(self, _options: CallbackOptions) -> Iterable[Observation]:
        for worker_id, stats in self.workers().items():
            for phase in ("prefill", "decode"):
                value = getattr(stats, f"{phase}_tokens_per_s", None)
                if value is not None:
                    yield Observation(value, {"worker": worker_id, "phase": phase})

    # ----------------------------------------------------------------- lifecycle
    def shutdown(self) -> None:
        """Flush spans and stop the providers (idempotent)."""
        for request_id in list(self._open_spans):
            self.end_request(request_id, None)
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
            self._tracer_provider = None
            self.tracer = None
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
            self._meter_provider = None


def _worker_view(stats: Any) -> dict[str, Any]:
    fields = (
        "num_running",
        "num_waiting",
        "kv_cache_usage",
        "step_token_budget",
        "num_preemptions",
        "num_recomputed_tokens",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
    )
    return {name: getattr(stats, name, None) for name in fields}
