"""The process's telemetry: OpenTelemetry meters and tracer, and the live view.

One `Telemetry` per app, built by the composition root from `TelemetryConfig`; it owns
its own MeterProvider, TracerProvider and Prometheus registry (never the global ones),
so two apps in one process do not mix their numbers.

The request path reports each finished request once (`request_finished`): latency
samples go to plain-Python histograms (gateway.observability.histograms), counts to
plain dicts that observable counters read when scraped, and the request's trace is
completed. Everything
else — queue depth, the engine's running/waiting sequences, KV utilisation, step token
budget, preemptions, recomputed tokens, tokens/s — is read when scraped, by observable
instruments over small probe functions the composition root hands in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry, generate_latest

from gateway.observability.config import TelemetryConfig
from gateway.observability.histograms import (
    HistogramSpec,
    PrometheusReaderWithHistograms,
    TierHistograms,
)
from gateway.observability.slo import (
    RecentOutcomes,
    SloTargets,
    billed_tokens,
    is_invalid,
    is_slo_met,
    tpot_ms,
)
from gateway.observability.span_export import ProcessSpanSink
from gateway.observability.tenant_labels import TenantLabels
from gateway.observability.tracing import (
    REQUEST_ID_ATTRIBUTE,
    SCOPE,
    RequestTimeline,
    RequestTrace,
    RequestTracer,
    to_span_processor,
)

log = logging.getLogger(__name__)

LATENCY_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
TPOT_BUCKETS_MS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 200, 500, 1000)
SLO_WINDOW_S = 300.0  # the attainment gauge looks back this far
METER_NAME = "tiergate.gateway"

# The per-tier latency histograms, by their index in HISTOGRAMS.
TTFT, TPOT, QUEUE_WAIT, E2E = range(4)
HISTOGRAMS = (
    HistogramSpec(
        "tiergate.ttft", "ms", "Time to first token (arrival to first token)", LATENCY_BUCKETS_MS
    ),
    HistogramSpec("tiergate.tpot", "ms", "Time per output token after the first", TPOT_BUCKETS_MS),
    HistogramSpec(
        "tiergate.queue_wait",
        "ms",
        "Time queued before a worker took the request",
        LATENCY_BUCKETS_MS,
    ),
    HistogramSpec("tiergate.e2e", "ms", "Arrival to last byte", LATENCY_BUCKETS_MS),
)

# Every gateway reads the queue and the workers' reports from the shared backend, so these
# series repeat on every gateway: summed across gateways they would count N times over.
SAME_ON_EVERY_GATEWAY = "every gateway reports the same value: take max, not sum, across gateways"
FLEET_QUEUE_NOTE = f" (fleet-wide, the shared queue; {SAME_ON_EVERY_GATEWAY})"
# A gateway without an engine reports every worker's latest report; a `serve` process
# its own engine only, under its worker id. Either way one worker's series is the same
# wherever it is read from.
WORKER_NOTE = (
    " (each worker's latest report, under its id in /admin/v1/queues; take max, not sum, "
    "across gateways)"
)

# The usage writer's counts (gateway.usage.UsageWriter), per gateway: records it wrote,
# records it lost (buffer full while the database was away, or one it cannot store),
# records not yet written.
USAGE_SERIES = {
    "num_written": ("tiergate.usage.records_written", "counter", "Usage records written"),
    "num_dropped": (
        "tiergate.usage.records_dropped",
        "counter",
        "Usage records lost: the buffer was full while the database refused writes, or "
        "the database refused the record alone while it took others",
    ),
    "num_pending": (
        "tiergate.usage.records_pending",
        "gauge",
        "Usage records not yet written (a growing value: the database is behind or away)",
    ),
}


class UsageCounts(Protocol):
    """What a gateway.usage.UsageWriter reports (kept apart: usage imports from here)."""

    num_written: int
    num_dropped: int

    @property
    def num_pending(self) -> int: ...


# Probes: () -> {tier: queued jobs}; () -> {worker id: engine stats}. A queue probe may
# carry `totals`: () -> {name: count since the queue began} (gateway.admin.queues).
QueueProbe = Callable[[], Mapping[str, int]]
WorkerProbe = Callable[[], Mapping[str, Any]]

# The queue's totals, as counters: name in the probe -> metric, unit, description. They
# count for the whole fleet (the shared queue), so every gateway reports the same value.
QUEUE_TOTALS = {
    "lease_expirations": (
        "tiergate.queue.lease_expirations",
        "{lease}",
        "Leases that ran out (their worker died or stalled) and were reclaimed" + FLEET_QUEUE_NOTE,
    ),
    "requeues": (
        "tiergate.queue.requeues",
        "{job}",
        "Jobs a worker handed back to the queue (drain, engine stopped)" + FLEET_QUEUE_NOTE,
    ),
    "abandoned_jobs": (
        "tiergate.queue.abandoned_jobs",
        "{job}",
        "Jobs ended because the gateway that queued them went away" + FLEET_QUEUE_NOTE,
    ),
}


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
    slo: SloTargets | None  # its tier's SLO when it ran (None: the tier's now)

    @property
    def decode_tokens(self) -> int: ...


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
        self._usage_writer: UsageCounts | None = None
        self._open_traces: dict[str, RequestTrace] = {}
        self._meter_provider: MeterProvider | None = None
        self._tracer_provider: TracerProvider | None = None
        self._request_tracer: RequestTracer | None = None
        self._span_sink: ProcessSpanSink | None = None
        # Cumulative counts, read by observable counters when scraped: a dict increment
        # on the request path instead of a synchronous instrument call per count.
        self._counts: dict[str, dict[tuple[str, ...], int]] = {
            "requests": {},
            "refusals": {},
            "slo": {},
            "tokens": {},
        }
        self._histograms = TierHistograms(HISTOGRAMS)
        if self.config.is_enabled:
            self._build_metrics()
        if self.config.is_tracing:
            self._build_tracing()

    # ----------------------------------------------------------------- setup
    def _resource(self) -> Resource:
        return Resource.create({"service.name": self.config.service_name})

    def _build_metrics(self) -> None:
        resource = self._resource()
        reader = PrometheusReaderWithHistograms(
            self._histograms,
            resource,
            InstrumentationScope(METER_NAME),
            registry=self.registry,
            scope_info_enabled=False,
        )
        self._meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
        meter = self._meter_provider.get_meter(METER_NAME)
        counters = {
            "requests": (
                "tiergate.requests",
                ("tier", "tenant", "outcome"),
                "{request}",
                "Requests by tier, tenant, outcome",
            ),
            "refusals": (
                "tiergate.refusals",
                ("tier", "code"),
                "{request}",
                "Requests refused, by code",
            ),
            "slo": (
                "tiergate.slo.requests",
                ("tier", "met"),
                "{request}",
                "Requests by tier and whether they met its SLO (refusals miss)",
            ),
            "tokens": (
                "tiergate.tokens",
                ("tier", "kind"),
                "{token}",
                "Tokens served, by tier and kind",
            ),
        }
        for family, (name, labels, unit, description) in counters.items():
            meter.create_observable_counter(
                name,
                callbacks=[self._count_callback(family, labels)],
                unit=unit,
                description=description,
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
            description="Requests queued, by tier" + FLEET_QUEUE_NOTE,
        )
        for total, (name, unit, description) in QUEUE_TOTALS.items():
            meter.create_observable_counter(
                name, callbacks=[self._total_callback(total)], unit=unit, description=description
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
                name,
                callbacks=[self._worker_callback(field)],
                unit=unit,
                description=description + WORKER_NOTE,
            )
        meter.create_observable_counter(
            "tiergate.engine.preemptions",
            callbacks=[self._worker_callback("num_preemptions")],
            unit="{preemption}",
            description="Sequences preempted by the engine" + WORKER_NOTE,
        )
        meter.create_observable_counter(
            "tiergate.engine.recomputed_tokens",
            callbacks=[self._worker_callback("num_recomputed_tokens")],
            unit="{token}",
            description="Tokens recomputed after preemption" + WORKER_NOTE,
        )
        meter.create_observable_gauge(
            "tiergate.engine.token_rate",
            callbacks=[self._observe_tokens_per_s],
            unit="{token}/s",
            description="Engine throughput (smoothed), by phase" + WORKER_NOTE,
        )

        for field, (name, kind, description) in USAGE_SERIES.items():
            create = (
                meter.create_observable_counter
                if kind == "counter"
                else meter.create_observable_gauge
            )
            create(
                name,
                callbacks=[self._usage_callback(field)],
                unit="{record}",
                description=description,
            )

    def _build_tracing(self) -> None:
        # The provider reads the sampler from OTEL_TRACES_SAMPLER*; the spans themselves
        # are built by RequestTracer and exported by a process of their own, or by the
        # exporter object the caller handed in (in this process).
        self._tracer_provider = TracerProvider(resource=self._resource())
        resource = self._tracer_provider.resource
        if self.config.span_exporter is not None:
            processor = BatchSpanProcessor(self.config.span_exporter)
            self._tracer_provider.add_span_processor(processor)
            sink = to_span_processor(processor, resource)
        else:
            self._span_sink = ProcessSpanSink(resource, SCOPE)
            sink = self._span_sink.add
        self._request_tracer = RequestTracer(self._tracer_provider.sampler, sink)

    @property
    def is_tracing(self) -> bool:
        return self._request_tracer is not None

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

    def watch_usage(self, writer: UsageCounts) -> None:
        """Report the usage writer's counts (USAGE_SERIES)."""
        self._usage_writer = writer

    # ----------------------------------------------------------------- requests
    def start_request(
        self, request_id: str, method: str, path: str, traceparent: str | None = None
    ) -> str | None:
        """Open the request's trace; returns its trace id (hex), None if not tracing."""
        if self._request_tracer is None:
            return None
        trace_id, trace = self._request_tracer.start(
            f"{method} {path}",
            traceparent,
            {
                REQUEST_ID_ATTRIBUTE: request_id,
                "http.request.method": method,
                "url.path": path,
            },
        )
        if trace is not None:
            self._open_traces[request_id] = trace
        return trace_id

    def end_request(self, request_id: str, status_code: int | None) -> None:
        """Close the request's trace once the response is sent (or the connection dropped)."""
        trace = self._open_traces.pop(request_id, None)
        if trace is None or self._request_tracer is None:
            return
        if status_code is not None:
            trace.attributes["http.response.status_code"] = status_code
        try:
            self._request_tracer.finish(trace)
        except Exception:  # telemetry must not fail the request it describes
            log.exception("telemetry dropped the trace of request %s", request_id)

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
        tpot = tpot_ms(record.e2e_ms, record.ttft_ms, record.decode_tokens)
        targets = record.slo or self._slo_targets.get(record.tier, SloTargets())
        # A client that went away is neither a hit nor a miss: it did not wait for one;
        # nor is a client's own mistake (a bad request) one of the service's.
        is_mistake = is_invalid(outcome)
        is_counted = outcome != "aborted" and not is_mistake
        is_met = is_slo_met(targets, is_ok=is_ok, ttft_ms=record.ttft_ms, tpot_ms=tpot)
        # Tokens as the usage report bills them: a prompt refused, or left in the queue,
        # was never processed; a refused request's output reached nobody.
        num_input_tokens, num_output_tokens = billed_tokens(
            outcome, record.queue_wait_ms, record.prompt_tokens, record.completion_tokens
        )
        self.recent.add(
            tier=record.tier,
            tenant_id=record.tenant_id,
            is_met=is_met,
            num_tokens=num_input_tokens + num_output_tokens,
            refusal_code=refusal_code,
            is_counted=is_counted,
        )
        if self._meter_provider is not None:
            counts = self._counts
            tenant = self.tenant_labels.observe(record.tenant_id)
            kind = "rejected" if refusal_code is not None else outcome
            if is_mistake:
                kind = "invalid"
            _bump(counts["requests"], (record.tier, tenant, kind), 1)
            if refusal_code is not None:
                _bump(counts["refusals"], (record.tier, refusal_code), 1)
            if is_counted:
                _bump(counts["slo"], (record.tier, "true" if is_met else "false"), 1)
            if num_input_tokens:
                _bump(counts["tokens"], (record.tier, "input"), num_input_tokens)
            if num_output_tokens:
                _bump(counts["tokens"], (record.tier, "output"), num_output_tokens)
            histograms = self._histograms
            if record.ttft_ms is not None:
                histograms.record(TTFT, record.tier, record.ttft_ms)
            if tpot is not None:
                histograms.record(TPOT, record.tier, tpot)
            if record.queue_wait_ms is not None:
                histograms.record(QUEUE_WAIT, record.tier, record.queue_wait_ms)
            if refusal_code is None and not is_mistake:
                # A request the service ran; a refusal's or a bad request's sub-millisecond
                # answer would pull the tier's end-to-end percentiles down.
                histograms.record(E2E, record.tier, record.e2e_ms)
        trace = self._open_traces.get(record.request_id)
        if trace is not None:
            trace.attributes["tiergate.tier"] = record.tier
            trace.attributes["tiergate.tenant_id"] = record.tenant_id
            trace.timeline = timeline
            trace.outcome = outcome

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

    def queue_totals(self) -> dict[str, int]:
        totals = getattr(self._queue_probe, "totals", None)
        if totals is None:
            return {}
        try:
            return {str(k): int(v) for k, v in totals().items()}
        except Exception:  # a probe must never break a scrape
            log.exception("queue totals probe failed")
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
    def _count_callback(
        self, family: str, labels: tuple[str, ...]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        counts = self._counts[family]

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            for key, value in list(counts.items()):
                yield Observation(value, dict(zip(labels, key, strict=True)))

        return observe

    def _observe_attainment(self, _options: CallbackOptions) -> Iterable[Observation]:
        for tier, share in self.recent.attainment(SLO_WINDOW_S).items():
            yield Observation(share, {"tier": tier})

    def _observe_queue(self, _options: CallbackOptions) -> Iterable[Observation]:
        depths = self.queue_depths()
        for tier in set(self._tier_ranks) | set(depths):
            yield Observation(depths.get(tier, 0), {"tier": tier})

    def _total_callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            value = self.queue_totals().get(name)
            if value is not None:  # not read yet: no sample rather than a false 0
                yield Observation(value)

        return observe

    def _usage_callback(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            if self._usage_writer is not None:
                yield Observation(getattr(self._usage_writer, field))

        return observe

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
        for request_id in list(self._open_traces):
            self.end_request(request_id, None)
        if self._span_sink is not None:
            self._span_sink.shutdown()
            self._span_sink = None
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
            self._tracer_provider = None
            self._request_tracer = None
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
            self._meter_provider = None


def _bump(counts: dict[tuple[str, ...], int], key: tuple[str, ...], by: int) -> None:
    counts[key] = counts.get(key, 0) + by


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
