"""Traces: one span tree per request, exported over OTLP/HTTP to a real receiver.

The receiver is a small HTTP server decoding the OTLP protobuf the exporter sends; the
gateway is configured only through the standard OTEL_* variables.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.app import build_app
from gateway.observability import TelemetryConfig
from gateway.settings import Settings
from tests.gateway.conftest import LiveServer, ServerThread, _create_tenants, build_test_engine

MODEL = "tiny-random"
PHASES = {"auth", "admission", "queue_wait", "prefill", "decode"}


class OtlpReceiver:
    """Collects the spans POSTed to /v1/traces, flattened to dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/traces", self._traces, methods=["POST"])])
        self.thread = ServerThread(app)

    async def _traces(self, request: Request) -> Response:
        message = ExportTraceServiceRequest.FromString(await request.body())
        with self._lock:
            for resource_spans in message.resource_spans:
                service = {
                    a.key: a.value.string_value for a in resource_spans.resource.attributes
                }.get("service.name")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            {
                                "name": span.name,
                                "service": service,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_id": span.parent_span_id.hex(),
                                "start_ns": span.start_time_unix_nano,
                                "end_ns": span.end_time_unix_nano,
                                "attributes": {
                                    a.key: a.value.string_value or a.value.int_value
                                    for a in span.attributes
                                },
                            }
                        )
        body = ExportTraceServiceResponse().SerializeToString()
        return Response(body, media_type="application/x-protobuf")


def _with_tenants(server: ServerThread, settings: Settings) -> LiveServer:
    """The running server as a LiveServer, with the test tenants created through its
    admin API."""
    live = LiveServer(
        base_url=f"http://127.0.0.1:{server.port}",
        admin_token=settings.admin_token or "",
        database_url=settings.db_url,
        engine=None,
    )
    _create_tenants(live)
    return live


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.thread.start()
    try:
        yield receiver
    finally:
        receiver.thread.stop()


def test_each_request_exports_one_span_tree(
    receiver: OtlpReceiver, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.thread.port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tiergate-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    config = TelemetryConfig.from_env()
    assert config.is_tracing
    settings = Settings(data_dir=tmp_path, admin_token="admin-token-for-tracing", device="cpu")
    server = ServerThread(build_app(settings, engine=build_test_engine(), telemetry_config=config))
    server.start()
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)  # the lifespan shuts telemetry down: spans flush
        live = _with_tenants(server, settings)
        client = stack.enter_context(live.client())
        parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "trace me"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_headers={"traceparent": f"00-{parent_trace}-00f067aa0ba902b7-01"},
        )
        streamed_id = raw.headers["x-request-id"]
        assert list(raw.parse())
        plain = client.completions.with_raw_response.create(
            model=MODEL, prompt="plain", max_tokens=3, temperature=0
        )
        plain_id = plain.headers["x-request-id"]
        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        refused_id = refused.value.response.headers["x-request-id"]
        assert httpx.get(f"{live.base_url}/healthz").status_code == 200

    by_request: dict[str, list[dict[str, Any]]] = {}
    for span in receiver.spans:
        by_request.setdefault(span["attributes"].get("tiergate.request_id"), []).append(span)
    assert None not in by_request, "every span carries the request id (no /healthz span)"

    streamed = {s["name"]: s for s in by_request[streamed_id]}
    root = streamed["POST /v1/chat/completions"]
    assert set(streamed) == {root["name"], "stream"} | PHASES
    assert root["trace_id"] == parent_trace  # the incoming traceparent is continued
    assert root["service"] == "tiergate-test"
    assert root["attributes"]["http.response.status_code"] == 200
    assert root["attributes"]["tiergate.outcome"] == "ok"
    for name in PHASES | {"stream"}:
        child = streamed[name]
        assert child["parent_id"] == root["span_id"], name
        assert child["trace_id"] == parent_trace
        assert root["start_ns"] <= child["start_ns"] <= child["end_ns"] <= root["end_ns"], name
    # The phases follow one another.
    order = ["auth", "admission", "queue_wait", "prefill", "decode"]
    for earlier, later in itertools.pairwise(order):
        assert streamed[earlier]["end_ns"] <= streamed[later]["start_ns"] + 1_000, (earlier, later)

    plain_spans = {s["name"] for s in by_request[plain_id]}
    assert plain_spans == {"POST /v1/completions"} | PHASES
    assert len({s["trace_id"] for s in by_request[plain_id]}) == 1
    assert by_request[plain_id][0]["trace_id"] != parent_trace

    refused_spans = {s["name"]: s for s in by_request[refused_id]}
    assert set(refused_spans) == {"POST /v1/completions", "auth", "admission"}
    refused_root = refused_spans["POST /v1/completions"]
    assert refused_root["attributes"]["http.response.status_code"] == 404
    assert refused_root["attributes"]["tiergate.outcome"] == "invalid:model_not_found"


@pytest.mark.parametrize(
    ("sampler", "traceparent_flags", "is_exported"),
    [
        ("parentbased_always_on", "00", False),  # the caller chose not to sample
        ("parentbased_always_on", "01", True),
        ("always_off", None, False),
    ],
)
def test_the_configured_sampler_decides_per_request(
    receiver: OtlpReceiver,
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
    sampler: str,
    traceparent_flags: str | None,
    is_exported: bool,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.thread.port}")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    settings = Settings(data_dir=tmp_path, admin_token="admin-token-for-sampling", device="cpu")
    app = build_app(
        settings, engine=build_test_engine(), telemetry_config=TelemetryConfig.from_env()
    )
    server = ServerThread(app)
    server.start()
    headers = {}
    if traceparent_flags is not None:
        headers["traceparent"] = (
            f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{traceparent_flags}"
        )
    try:
        live = _with_tenants(server, settings)
        with live.client() as client:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="sample me?", max_tokens=2, temperature=0, extra_headers=headers
            )
        request_id = raw.headers["x-request-id"]
    finally:
        server.stop()  # flushes the exporter
    names = {
        s["name"]
        for s in receiver.spans
        if s["attributes"].get("tiergate.request_id") == request_id
    }
    assert names == ({"POST /v1/completions"} | PHASES if is_exported else set())
