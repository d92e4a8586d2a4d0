"""One span tree per request, built from the request's timeline when it finishes.

The middleware opens the root span (`POST /v1/chat/completions`) when the request
arrives, continuing an incoming W3C `traceparent` if there is one. The phases — auth,
admission, queue wait, prefill, decode, stream — are recorded as plain monotonic
timestamps on the request path (no context juggling across the dispatcher's tasks) and
turned into child spans with explicit start and end times once the request is done.
Every span carries `tiergate.request_id`, the value of the `x-request-id` header.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

REQUEST_ID_ATTRIBUTE = "tiergate.request_id"


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


def record_phases(
    tracer: Tracer, root: Span, timeline: RequestTimeline, request_id: str, outcome: str
) -> None:
    """Add the request's phases as children of `root`, at the times they happened."""
    now_s, now_ns = time.monotonic(), time.time_ns()
    end_s = timeline.finished_s or now_s

    def to_ns(monotonic_s: float) -> int:
        return now_ns - int((now_s - monotonic_s) * 1e9)

    parent = trace.set_span_in_context(root)
    for name, start_s, stop_s in _phases(timeline, end_s):
        span = tracer.start_span(
            name,
            context=parent,
            start_time=to_ns(start_s),
            attributes={REQUEST_ID_ATTRIBUTE: request_id},
        )
        span.end(end_time=to_ns(stop_s))
    root.set_attribute("tiergate.outcome", outcome)
    if outcome not in ("ok", "aborted") and not outcome.startswith("rejected:"):
        root.set_status(Status(StatusCode.ERROR, outcome))
