"""The OTLP encoder against the SDK's, and the exporter against a real OTLP receiver."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
    encode_spans as sdk_encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.observability.otlp import (
    OtlpConfigError,
    OtlpHttpSpanExporter,
    encode_spans,
    parse_headers,
)
from gateway.observability.span_export import EXPORT_NICENESS, ProcessSpanSink
from gateway.observability.tracing import TraceRecord
from tests.fleet_processes import free_port
from tests.gateway.conftest import ROOT, ServerThread, output_until_started, reap

RESOURCE = Resource.create({"service.name": "tiergate-test", "deployment": "ci"})
SCOPES = [InstrumentationScope("tiergate.gateway"), InstrumentationScope("other", "1.2")]

ids = st.integers(min_value=1, max_value=2**64 - 1)
attribute_values = st.one_of(
    st.text(max_size=20),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.lists(st.text(max_size=5), max_size=3).map(tuple),
)


@st.composite
def spans(draw) -> ReadableSpan:
    trace_state = draw(st.sampled_from([None, TraceState([("vendor", "x1")])]))
    context = SpanContext(
        draw(st.integers(min_value=1, max_value=2**128 - 1)),
        draw(ids),
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=trace_state,
    )
    parent = draw(
        st.one_of(
            st.none(),
            st.builds(
                lambda i, r: SpanContext(context.trace_id, i, is_remote=r), ids, st.booleans()
            ),
        )
    )
    status = draw(
        st.sampled_from(
            [Status(), Status(StatusCode.OK), Status(StatusCode.ERROR, "rejected:queue_full")]
        )
    )
    start = draw(st.integers(min_value=0, max_value=2**63))
    return ReadableSpan(
        draw(st.text(min_size=1, max_size=30)),
        context,
        parent,
        RESOURCE,
        draw(st.dictionaries(st.text(min_size=1, max_size=10), attribute_values, max_size=4)),
        kind=draw(st.sampled_from(list(SpanKind))),
        instrumentation_scope=draw(st.sampled_from(SCOPES)),
        status=status,
        start_time=start,
        end_time=start + draw(st.integers(min_value=0, max_value=10**9)),
    )


@given(st.lists(spans(), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_encoding_parses_to_the_sdk_encoders_message(batch: list[ReadableSpan]) -> None:
    ours = ExportTraceServiceRequest.FromString(encode_spans(batch))
    assert ours == sdk_encode_spans(batch)


class Receiver:
    """An OTLP/HTTP endpoint that records what it is sent, failing the first `fail` posts."""

    def __init__(self, fail: int = 0, status: int = 503) -> None:
        self.posts: list[tuple[dict[str, str], ExportTraceServiceRequest]] = []
        self.fail, self.status = fail, status
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])
        self.thread = ServerThread(app)

    async def _traces(self, request: Request) -> Response:
        body = await request.body()
        with self._lock:
            if self.fail > 0:
                self.fail -= 1
                return Response(status_code=self.status)
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            self.posts.append((dict(request.headers), ExportTraceServiceRequest.FromString(body)))
        return Response(b"", media_type="application/x-protobuf")


@pytest.fixture
def receiver(request: pytest.FixtureRequest):
    receiver = Receiver(*getattr(request, "param", ()))
    receiver.thread.start()
    yield receiver
    receiver.thread.stop()


def _one_span() -> ReadableSpan:
    context = SpanContext(7, 9, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(
        "POST /v1/completions", context, None, RESOURCE, {"tiergate.request_id": "req-1"},
        kind=SpanKind.SERVER, instrumentation_scope=SCOPES[0], start_time=1, end_time=2,
    )  # fmt: skip


def test_exporter_posts_with_headers_and_gzip(receiver: Receiver) -> None:
    exporter = OtlpHttpSpanExporter(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.thread.port}/",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=s%3Dcret, Tenant=acme",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        }
    )
    try:
        assert exporter.export([_one_span()]) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    [(headers, message)] = receiver.posts
    assert headers["x-api-key"] == "s=cret"
    assert headers["tenant"] == "acme"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["content-encoding"] == "gzip"
    [span] = message.resource_spans[0].scope_spans[0].spans
    assert span.name == "POST /v1/completions"
    assert exporter.export([_one_span()]) is SpanExportResult.FAILURE  # after shutdown


@pytest.mark.parametrize("receiver", [(2, 503)], indirect=True)
def test_exporter_retries_a_busy_receiver(receiver: Receiver) -> None:
    exporter = OtlpHttpSpanExporter(
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.thread.port}/v1/traces"}
    )
    try:
        assert exporter.export([_one_span()]) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert len(receiver.posts) == 1
    assert receiver.fail == 0


@pytest.mark.parametrize("receiver", [(1, 400)], indirect=True)
def test_exporter_does_not_retry_a_refusal(receiver: Receiver) -> None:
    exporter = OtlpHttpSpanExporter(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.thread.port}"}
    )
    try:
        assert exporter.export([_one_span()]) is SpanExportResult.FAILURE
        assert exporter.export([_one_span()]) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    assert len(receiver.posts) == 1


def test_exporter_gives_up_within_its_timeout() -> None:
    exporter = OtlpHttpSpanExporter(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_TIMEOUT": "800"}
    )
    try:
        assert exporter.export([_one_span()]) is SpanExportResult.FAILURE
    finally:
        exporter.shutdown()


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"},
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "0"},
        {"OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"},
        {"OTEL_EXPORTER_OTLP_HEADERS": "no-equals-sign"},
    ],
)
def test_bad_exporter_settings_are_refused(environ: dict[str, str]) -> None:
    with pytest.raises(OtlpConfigError):
        OtlpHttpSpanExporter(environ)


def test_headers_parse_like_the_specification() -> None:
    assert parse_headers("") == {}
    assert parse_headers("a=1,B=x%20y, c = 3 ") == {"a": "1", "b": "x y", "c": "3"}


def _records(n: int) -> list[tuple]:
    """Requests refused before any phase: one span (the root) each."""
    return [
        tuple(
            TraceRecord(
                "POST /v1/completions",
                7,
                100 + i,
                9,
                False,
                0,
                1,
                0.0,
                {"tiergate.request_id": f"r{i}"},
                0,
                "",
                "",
                None,
            )
        )
        for i in range(n)
    ]


def test_export_process_delivers_every_span_and_stops(receiver: Receiver) -> None:
    environ = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.thread.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "700",  # spans: 100 requests of up to 7
    }
    sink = ProcessSpanSink(RESOURCE, SCOPES[0], environ)
    assert sink.batch_size == 100
    # Serving comes first: the child exports at a lower CPU priority than the gateway.
    deadline = time.monotonic() + 20
    own = os.getpriority(os.PRIO_PROCESS, 0)
    while own < 19 and os.getpriority(os.PRIO_PROCESS, sink._process.pid) == own:
        assert time.monotonic() < deadline, "the export process kept the gateway's priority"
        time.sleep(0.05)
    expected = min(own + EXPORT_NICENESS, 19)  # nice values stop at 19
    assert os.getpriority(os.PRIO_PROCESS, sink._process.pid) == expected
    for record in _records(250):  # two full batches go at once, the rest on the timer
        sink.add(record)
    deadline = time.monotonic() + 20
    while sum(_count(m) for _, m in receiver.posts) < 250 and time.monotonic() < deadline:
        time.sleep(0.05)
    for record in _records(5):  # left for shutdown to send
        sink.add(record)
    sink.shutdown()
    assert sink._process.returncode == 0
    spans = [
        s
        for _, m in receiver.posts
        for rs in m.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    assert len(spans) == 255
    assert {s.name for s in spans} == {"POST /v1/completions"}
    assert sink.num_dropped == 0
    resource = receiver.posts[0][1].resource_spans[0].resource
    assert {a.key: a.value.string_value for a in resource.attributes}["deployment"] == "ci"


@pytest.fixture
def orphaned_sink(receiver: Receiver) -> ProcessSpanSink:
    """A span sink whose export process has died."""
    environ = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.thread.port}",
    }
    sink = ProcessSpanSink(RESOURCE, SCOPES[0], environ)
    sink._process.kill()
    sink._process.wait()
    return sink


def test_a_dead_export_process_costs_spans_not_requests(orphaned_sink: ProcessSpanSink) -> None:
    sink = orphaned_sink
    for _ in range(300):  # fills the socket buffer, then drops
        sink._ship(_records(100))
    assert sink.num_dropped > 0
    sink.shutdown(timeout_s=1)


def _count(message: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)


def test_shutdown_ends_at_once_when_the_export_process_is_gone(
    orphaned_sink: ProcessSpanSink,
) -> None:
    # It kept offering its last datagram to the dead child until its deadline (10 s).
    sink = orphaned_sink
    started = time.monotonic()
    sink.shutdown(timeout_s=10)
    assert time.monotonic() - started < 2


def test_ctrl_c_of_a_tracing_serve_ends_it_at_once_and_quietly(tmp_path: Path) -> None:
    """A terminal's ^C goes to the whole process group, the export process included: it
    died with a KeyboardInterrupt traceback, and serve then waited 10 s for it."""
    with socket.socket() as unused:  # nothing receives the spans; none are made anyway
        unused.bind(("127.0.0.1", 0))
        otlp_port = unused.getsockname()[1]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "TIERGATE_DATA_DIR": str(tmp_path),
            "TIERGATE_DEVICE": "cpu",
            "TIERGATE_MAX_MODEL_LEN": "256",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own, as a shell gives a command
    )
    try:
        output = output_until_started(proc)
        assert "Application startup complete" in output, output[-3000:]
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        output += proc.communicate(timeout=30)[0]
        took_s = time.monotonic() - started
    finally:
        reap(proc)
    assert took_s < 5, (took_s, output[-3000:])
    for noise in ("Traceback", "KeyboardInterrupt", "did not finish"):
        assert noise not in output, output[-3000:]
