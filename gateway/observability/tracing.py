"""One span tree per request, built from the request's timeline when it finishes.

The middleware opens the request's trace (`POST /v1/chat/completions`) when the request
arrives, continuing an incoming W3C `traceparent` if there is one. The phases — auth,
admission, queue wait, prefill, decode, stream — are recorded as plain monotonic
timestamps on the request path (no context juggling across the dispatcher's tasks).
When the response is sent, the root and its phases are emitted at once as finished spans
with explicit start and end times. Every span carries `tiergate.request_id`, the value
of the `x-request-id` header.

The spans are built as finished `ReadableSpan`s and handed straight to the span
processor, rather than started and ended through the SDK's tracer: every span here is
known only after the fact, and the tracer's bookkeeping (context objects, attribute
validation, locks, per-span sampling) cost more than the rest of the gateway's
observability together. The sampler is still consulted, once per request, for the root.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

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
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

REQUEST_ID_ATTRIBUTE = "tiergate.request_id"
SCOPE = InstrumentationScope("tiergate.gateway")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status()


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
    """Opens a trace per request (sampler permitting) and emits its finished span tree."""

    def __init__(self, sampler: Sampler, processor: SpanProcessor, resource: Resource) -> None:
        self._sampler = sampler
        self._processor = processor
        self._resource = resource
        self._propagator = TraceContextTextMapPropagator()

    def start(
        self, name: str, traceparent: str | None, attributes: dict[str, Any]
    ) -> tuple[str, RequestTrace | None]:
        """The request's trace id (hex, for the logs) and its trace if sampled."""
        parent_context = None
        parent: SpanContext | None = None
        if traceparent is not None:
            parent_context = self._propagator.extract({"traceparent": traceparent})
            parent = get_current_span(parent_context).get_span_context()
            if not parent.is_valid:
                parent, parent_context = None, None
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

        def to_ns(monotonic_s: float) -> int:
            return end_ns - int((end_s - monotonic_s) * 1e9)

        on_end = self._processor.on_end
        request_id = trace.attributes.get(REQUEST_ID_ATTRIBUTE)
        if trace.timeline is not None:
            last_s = trace.timeline.finished_s or end_s
            for name, start_s, stop_s in _phases(trace.timeline, last_s):
                span_context = SpanContext(
                    trace.context.trace_id,
                    _random_id(64, INVALID_SPAN_ID),
                    is_remote=False,
                    trace_flags=_SAMPLED,
                    trace_state=trace.context.trace_state,
                )
                on_end(
                    ReadableSpan(
                        name,
                        span_context,
                        trace.context,
                        self._resource,
                        {REQUEST_ID_ATTRIBUTE: request_id},
                        kind=SpanKind.INTERNAL,
                        instrumentation_scope=SCOPE,
                        status=_UNSET,
                        # A phase never starts before its root (clocks read apart).
                        start_time=max(to_ns(start_s), trace.start_ns),
                        end_time=min(to_ns(stop_s), end_ns),
                    )
                )
        status = _UNSET
        if trace.outcome is not None:
            trace.attributes["tiergate.outcome"] = trace.outcome
            if trace.outcome not in ("ok", "aborted") and not trace.outcome.startswith("rejected:"):
                status = Status(StatusCode.ERROR, trace.outcome)
        on_end(
            ReadableSpan(
                trace.name,
                trace.context,
                trace.parent,
                self._resource,
                trace.attributes,
                kind=SpanKind.SERVER,
                instrumentation_scope=SCOPE,
                status=status,
                start_time=trace.start_ns,
                end_time=end_ns,
            )
        )


def _random_id(bits: int, invalid: int) -> int:
    value = random.getrandbits(bits)
    while value == invalid:
        value = random.getrandbits(bits)
    return value
