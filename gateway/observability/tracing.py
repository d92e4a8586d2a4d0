"""One span tree per request, built from the request's timeline when it finishes.

The middleware opens the request's trace (`POST /v1/chat/completions`) when the request
arrives, continuing an incoming W3C `traceparent` if there is one. The phases — auth,
admission, queue wait, prefill, decode, stream — are recorded as plain monotonic
timestamps on the request path (no context juggling across the dispatcher's tasks).
When the response is sent, the root and the timeline go out as one `TraceRecord`; where
they are exported, `spans_of` turns them into the root and its phases as finished spans
with explicit start and end times. Every span carries `tiergate.request_id`, the value
of the `x-request-id` header.

No span goes through the SDK's tracer: every span here is known only after the fact,
and the tracer's bookkeeping (context objects, attribute validation, locks, per-span
sampling) cost more than the rest of the gateway's observability together. The sampler
is still consulted, once per request, for the root. The gateway's share is one tuple
per request; the phase spans are cut in the export process
(gateway.observability.span_export), or by an SDK span processor's sink in this process.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

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


class RequestTimeline(NamedTuple):
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


class TraceRecord(NamedTuple):
    """A finished request's root span and the timeline its phase spans are cut from.

    One per request, shipped as a plain tuple (`tuple(record)`: a named tuple pickles
    several times slower) and expanded into its spans by `spans_of` where they are
    exported, off the request path.
    """

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0: no parent
    is_parent_remote: bool
    start_ns: int
    end_ns: int
    end_s: float  # end_ns on the monotonic clock, to place the phases
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    trace_state: str
    timeline: tuple | None  # a RequestTimeline as a plain tuple


# The root and the six phases `_phases` may cut: what one request exports at most.
MAX_SPANS_PER_REQUEST = 7


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
    """Opens a trace per request (sampler permitting) and emits each finished one as a
    `TraceRecord` tuple to `sink` (the export process, or `to_span_processor`)."""

    def __init__(self, sampler: Sampler, sink: Callable[[tuple], None]) -> None:
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
        """Emit the request's record, the root ending now."""
        end_s, end_ns = time.monotonic(), time.time_ns()
        context = trace.context
        status_code, status_message = 0, ""
        if trace.outcome is not None:
            trace.attributes["tiergate.outcome"] = trace.outcome
            if trace.outcome not in ("ok", "aborted") and not trace.outcome.startswith(
                ("rejected:", "invalid:")
            ):
                status_code, status_message = StatusCode.ERROR.value, trace.outcome
        parent = trace.parent
        self._sink(
            (  # a TraceRecord's fields, in order, as a plain tuple
                trace.name,
                context.trace_id,
                context.span_id,
                parent.span_id if parent is not None else 0,
                parent is not None and parent.is_remote,
                trace.start_ns,
                end_ns,
                end_s,
                trace.attributes,
                status_code,
                status_message,
                context.trace_state.to_header() if context.trace_state else "",
                None if trace.timeline is None else tuple(trace.timeline),
            )
        )


def spans_of(record: tuple) -> list[SpanRecord]:
    """The spans of one request (a `TraceRecord` as a plain tuple): its phases, each a
    child of the root, then the root."""
    r = TraceRecord._make(record)
    spans = []
    if r.timeline is not None:
        timeline = RequestTimeline._make(r.timeline)
        phase_attributes = {REQUEST_ID_ATTRIBUTE: r.attributes.get(REQUEST_ID_ATTRIBUTE)}
        end_s, end_ns = r.end_s, r.end_ns
        for name, start_s, stop_s in _phases(timeline, timeline.finished_s or end_s):
            spans.append(
                SpanRecord(
                    name,
                    r.trace_id,
                    _random_id(64, INVALID_SPAN_ID),
                    r.span_id,
                    False,
                    _INTERNAL,
                    # A phase never starts before its root (clocks read apart).
                    max(end_ns - int((end_s - start_s) * 1e9), r.start_ns),
                    min(end_ns - int((end_s - stop_s) * 1e9), end_ns),
                    phase_attributes,
                    0,
                    "",
                    r.trace_state,
                )
            )
    spans.append(
        SpanRecord(
            r.name,
            r.trace_id,
            r.span_id,
            r.parent_span_id,
            r.is_parent_remote,
            _SERVER,
            r.start_ns,
            r.end_ns,
            r.attributes,
            r.status_code,
            r.status_message,
            r.trace_state,
        )
    )
    return spans


def to_span_processor(processor: SpanProcessor, resource: Resource) -> Callable[[tuple], None]:
    """A sink handing each request's spans, as SDK spans, to `processor` (for an
    exporter object the caller built, which runs in this process)."""

    def sink(record: tuple) -> None:
        for r in spans_of(record):
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
