"""One span tree per request, built from the request's timeline when it finishes.

The middleware opens the request's trace (`POST /v1/chat/completions`) when the request
arrives, continuing an incoming W3C `traceparent` if there is one. The phases — auth,
admission, queue wait, prefill, decode, stream — are recorded as plain monotonic
timestamps on the request path (no context juggling across the dispatcher's tasks).
When the response is sent, the root and its phases are emitted at once as finished spans
with explicit start and end times. Every span carries `tiergate.request_id`, the value
of the `x-request-id` header.

The spans are built as finished `SpanRecord`s (plain tuples) rather than started and
ended through the SDK's tracer: every span here is known only after the fact, and the
tracer's bookkeeping (context objects, attribute validation, locks, per-span sampling)
cost more than the rest of the gateway's observability together. The sampler is still
consulted, once per request, for the root. The records go to the export process
(gateway.observability.span_export), or to an SDK span processor in this process.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    INVALID_SPAN_ID,
    INVALID_TRACE_ID,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observability.otlp import SpanRecord

REQUEST_ID_ATTRIBUTE = "tiergate.request_id"
SCOPE = InstrumentationScope("tiergate.gateway")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_INTERNAL, _SERVER = SpanKind.INTERNAL.value, SpanKind.SERVER.value
_NO_PARENT = Context()


@dataclass(frozen=True)
class RequestTimeline:
    """Monotonic timestamps (time.monotonic() seconds) of one request's phases.

    A phase that did not happen (refused before the queue, no token produced) is None.
    """

    started_s: float
    authenticated_s: float | None = None
    enqueued_s: float | None = None
    dispatched_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    is_stream: bool = False


def _phases(t: RequestTimeline, end_s: float) -> list[tuple[str, float, float]]:
    phases: list[tuple[str, float, float]] = []

    def add(name: str, start: float | None, end: float | None) -> None:
        if start is not None and end is not None and end >= start:
            phases.append((name, start, end))

    add("auth", t.started_s, t.authenticated_s)
    add("admission", t.authenticated_s, t.enqueued_s or end_s)
    add("queue_wait", t.enqueued_s, t.dispatched_s or (end_s if t.enqueued_s else None))
    add("prefill", t.dispatched_s, t.first_token_s or (end_s if t.dispatched_s else None))
    add("decode", t.first_token_s, t.last_token_s or (end_s if t.first_token_s else None))
    if t.is_stream:
        add("stream", t.first_token_s, end_s)
    return phases


@dataclass
class RequestTrace:
    """A sampled request's root span, open until the response is sent."""

    name: str
    context: SpanContext
    parent: SpanContext | None
    start_ns: int
    start_s: float  # the same instant on the monotonic clock, to place the phases
    attributes: dict[str, Any]
    timeline: RequestTimeline | None = None
    outcome: str | None = None


class RequestTracer:
    """Opens a trace per request (sampler permitting) and emits its finished span tree
    as `SpanRecord`s to `sink` (the export process, or `to_span_processor`)."""

    def __init__(self, sampler: Sampler, sink: Callable[[list[SpanRecord]], None]) -> None:
        self._sampler = sampler
        self._sink = sink
        self._propagator = TraceContextTextMapPropagator()

    def start(
        self, name: str, traceparent: str | None, attributes: dict[str, Any]
    ) -> tuple[str, RequestTrace | None]:
        """The request's trace id (hex, for the logs) and its trace if sampled."""
        # The parent comes only from the header: the sampler is handed an explicit
        # context, never left to read the current one (which the request never set).
        parent_context = _NO_PARENT
        parent: SpanContext | None = None
        if traceparent is not None:
            parent_context = self._propagator.extract({"traceparent": traceparent})
            parent = get_current_span(parent_context).get_span_context()
            if not parent.is_valid:
                parent, parent_context = None, _NO_PARENT
        trace_id = parent.trace_id if parent is not None else _random_id(128, INVALID_TRACE_ID)
        sampling = self._sampler.should_sample(
            parent_context, trace_id, name, SpanKind.SERVER, attributes
        )
        trace_hex = format(trace_id, "032x")
        if not sampling.decision.is_sampled():
            return trace_hex, None
        context = SpanContext(
            trace_id,
            _random_id(64, INVALID_SPAN_ID),
            is_remote=False,
            trace_flags=_SAMPLED,
            trace_state=sampling.trace_state,
        )
        if sampling.attributes:
            attributes.update(sampling.attributes)
        trace = RequestTrace(name, context, parent, time.time_ns(), time.monotonic(), attributes)
        return trace_hex, trace

    def finish(self, trace: RequestTrace) -> None:
        """Emit the root span and its phases, the root ending now."""
        end_s, end_ns = time.monotonic(), time.time_ns()
        trace_id, root_id = trace.context.trace_id, trace.context.span_id
        trace_state = trace.context.trace_state.to_header() if trace.context.trace_state else ""
        records = []
        if trace.timeline is not None:
            phase_attributes = {REQUEST_ID_ATTRIBUTE: trace.attributes.get(REQUEST_ID_ATTRIBUTE)}
            last_s = trace.timeline.finished_s or end_s
            for name, start_s, stop_s in _phases(trace.timeline, last_s):
                records.append(
                    SpanRecord(
                        name,
                        trace_id,
                        _random_id(64, INVALID_SPAN_ID),
                        root_id,
                        False,
                        _INTERNAL,
                        # A phase never starts before its root (clocks read apart).
                        max(end_ns - int((end_s - start_s) * 1e9), trace.start_ns),
                        min(end_ns - int((end_s - stop_s) * 1e9), end_ns),
                        phase_attributes,
                        0,
                        "",
                        trace_state,
                    )
                )
        status_code, status_message = 0, ""
        if trace.outcome is not None:
            trace.attributes["tiergate.outcome"] = trace.outcome
            if trace.outcome not in ("ok", "aborted") and not trace.outcome.startswith("rejected:"):
                status_code, status_message = StatusCode.ERROR.value, trace.outcome
        parent = trace.parent
        records.append(
            SpanRecord(
                trace.name,
                trace_id,
                root_id,
                parent.span_id if parent is not None else 0,
                parent is not None and parent.is_remote,
                _SERVER,
                trace.start_ns,
                end_ns,
                trace.attributes,
                status_code,
                status_message,
                trace_state,
            )
        )
        self._sink(records)


def to_span_processor(
    processor: SpanProcessor, resource: Resource
) -> Callable[[list[SpanRecord]], None]:
    """A sink handing the records, as SDK spans, to `processor` (for an exporter object
    the caller built, which runs in this process)."""

    def sink(records: list[SpanRecord]) -> None:
        for r in records:
            flags = TraceFlags(TraceFlags.SAMPLED)
            trace_state = TraceState.from_header([r.trace_state]) if r.trace_state else None
            parent = None
            if r.parent_span_id:
                parent = SpanContext(r.trace_id, r.parent_span_id, r.is_parent_remote, flags)
            processor.on_end(
                ReadableSpan(
                    r.name,
                    SpanContext(r.trace_id, r.span_id, False, flags, trace_state),
                    parent,
                    resource,
                    dict(r.attributes),
                    kind=SpanKind(r.kind),
                    instrumentation_scope=SCOPE,
                    status=Status(StatusCode(r.status_code), r.status_message or None),
                    start_time=r.start_ns,
                    end_time=r.end_ns,
                )
            )

    return sink


def _random_id(bits: int, invalid: int) -> int:
    value = random.getrandbits(bits)
    while value == invalid:
        value = random.getrandbits(bits)
    return value
