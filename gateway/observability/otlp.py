"""OTLP/HTTP span export with a small protobuf encoder for the gateway's own spans.

The SDK's OTLP encoder builds a protobuf message object per span, attribute and value
(~17 µs a span here), and it runs on the gateway's one interpreter lock: at six spans a
request it cost more than the rest of observability together. The spans this gateway
emits are few in shape (a root and its phases, string/int/bool/float attributes, no
events or links), so `encode_spans` writes the OTLP wire format directly; a test checks
that the official protobuf classes parse it to the same message the SDK's encoder
builds.

`OtlpHttpSpanExporter` posts the bytes as OTLP/HTTP protobuf and reads the standard
variables: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT (milliseconds, as the
specification says), _COMPRESSION (gzip or none) and _CERTIFICATE. It retries what the
specification calls retryable (429, 502, 503, 504, connection errors) with exponential
backoff within the timeout.
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import unquote

import httpx
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "/v1/traces"
DEFAULT_TIMEOUT_MS = 10_000
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")


class OtlpConfigError(ValueError):
    """An OTEL_EXPORTER_OTLP_* variable holds a value that cannot be used."""


# ----------------------------------------------------------------- wire format
_SMALL = [bytes([n]) for n in range(128)]  # a varint below 128 is one byte


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    """A length-delimited field (strings, bytes, nested messages)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    if isinstance(value, str):
        return _len_field(1, value.encode())
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64, two's complement
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _len_field(7, value)
    if isinstance(value, Sequence):  # ArrayValue of AnyValues
        items = b"".join(_len_field(1, _any_value(v)) for v in value)
        return _len_field(5, items)
    return _len_field(1, str(value).encode())


# Span names and attribute keys repeat on every request: encode each once.
_names: dict[str, bytes] = {}
_keys: dict[str, bytes] = {}
_CACHE_LIMIT = 4096  # names and keys come from code, but never let them grow unbounded


def _cached(cache: dict[str, bytes], field: int, text: str) -> bytes:
    encoded = cache.get(text)
    if encoded is None:
        encoded = _len_field(field, text.encode())
        if len(cache) < _CACHE_LIMIT:
            cache[text] = encoded
    return encoded


def _key_values(field: int, attributes: Mapping[str, Any] | None) -> bytes:
    if not attributes:
        return b""
    tag = _varint(field << 3 | 2)
    out = []
    for key, value in attributes.items():
        if type(value) is str:
            encoded = value.encode()
            any_value = b"\x0a" + _varint(len(encoded)) + encoded
        else:
            any_value = _any_value(value)
        pair = _cached(_keys, 1, key) + b"\x12" + _varint(len(any_value)) + any_value
        out.append(tag + _varint(len(pair)) + pair)
    return b"".join(out)


class SpanRecord(NamedTuple):
    """One finished span as plain values: what the encoder needs, cheap to build and to
    pickle (the gateway hands these to its export process)."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0: a root span
    is_parent_remote: bool
    kind: int  # opentelemetry.trace.SpanKind value
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    status_code: int = 0  # opentelemetry.trace.StatusCode value
    status_message: str = ""
    trace_state: str = ""  # W3C tracestate header


def record_of(span: ReadableSpan) -> SpanRecord:
    context, parent, status = span.context, span.parent, span.status
    return SpanRecord(
        span.name,
        context.trace_id,
        context.span_id,
        parent.span_id if parent is not None else 0,
        parent is not None and parent.is_remote,
        span.kind.value,
        span.start_time or 0,
        span.end_time or 0,
        span.attributes,
        status.status_code.value,
        status.description or "",
        context.trace_state.to_header() if context.trace_state else "",
    )


_UNSET_STATUS = b"\x7a\x00"  # field 15, empty: the SDK's encoder always writes a status
_FLAGS = {
    False: b"\x85\x01" + struct.pack("<I", 0x100),
    True: b"\x85\x01" + struct.pack("<I", 0x300),
}


def _span(r: SpanRecord) -> bytes:
    parts = [
        b"\x0a\x10" + r.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + r.span_id.to_bytes(8, "big"),
    ]
    if r.trace_state:
        parts.append(_len_field(3, r.trace_state.encode()))
    if r.parent_span_id:
        parts.append(b"\x22\x08" + r.parent_span_id.to_bytes(8, "big"))
    parts.append(_cached(_names, 5, r.name))
    parts.append(b"\x30" + _SMALL[r.kind + 1])  # OTLP kinds start at 1 (internal)
    parts.append(b"\x39" + _FIXED64.pack(r.start_ns))
    parts.append(b"\x41" + _FIXED64.pack(r.end_ns))
    parts.append(_key_values(9, r.attributes))
    if not r.status_code and not r.status_message:
        parts.append(_UNSET_STATUS)
    else:
        body = b""
        if r.status_message:
            body += _len_field(2, r.status_message.encode())
        if r.status_code:
            body += b"\x18" + _varint(r.status_code)
        parts.append(_len_field(15, body))
    # flags: whether the parent is remote is known (bit 8), and is it (bit 9); the
    # SDK's encoder sets these and no more.
    parts.append(_FLAGS[r.is_parent_remote])
    return b"".join(parts)


def _resource_spans(
    resource: Resource, by_scope: Mapping[InstrumentationScope | None, list[bytes]]
) -> bytes:
    body = _len_field(1, _key_values(1, resource.attributes))
    for scope, encoded in by_scope.items():
        scope_body = b""
        if scope is not None:
            scope_msg = _len_field(1, scope.name.encode())
            if scope.version:
                scope_msg += _len_field(2, scope.version.encode())
            scope_body = _len_field(1, scope_msg)
        scope_body += b"".join(_len_field(2, s) for s in encoded)
        if scope is not None and scope.schema_url:
            scope_body += _len_field(3, scope.schema_url.encode())
        body += _len_field(2, scope_body)
    if resource.schema_url:
        body += _len_field(3, resource.schema_url.encode())
    return _len_field(1, body)


def encode_records(
    resource: Resource, scope: InstrumentationScope, records: Sequence[SpanRecord]
) -> bytes:
    """An ExportTraceServiceRequest holding `records`, all of one resource and scope."""
    return _resource_spans(resource, {scope: [_span(r) for r in records]})


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """An ExportTraceServiceRequest holding `spans`, grouped by resource and scope."""
    grouped: dict[int, tuple[Any, dict[Any, list[bytes]]]] = {}
    for span in spans:
        resource = span.resource
        _, by_scope = grouped.setdefault(id(resource), (resource, {}))
        by_scope.setdefault(span.instrumentation_scope, []).append(_span(record_of(span)))
    return b"".join(_resource_spans(r, by_scope) for r, by_scope in grouped.values())


# ----------------------------------------------------------------- the exporter
def _env(environ: Mapping[str, str], name: str) -> str:
    """OTEL_EXPORTER_OTLP_TRACES_<name>, else OTEL_EXPORTER_OTLP_<name>."""
    value = environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}", "").strip()
    return value or environ.get(f"OTEL_EXPORTER_OTLP_{name}", "").strip()


def parse_headers(text: str) -> dict[str, str]:
    """`key1=value1,key2=value2` (values URL-encoded), as the OTLP variables carry them."""
    headers = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise OtlpConfigError(f"OTLP header {item.strip()!r} is not key=value")
        headers[unquote(key.strip()).lower()] = unquote(value.strip())
    return headers


class OtlpHttpSpanExporter(SpanExporter):
    """Posts spans as OTLP/HTTP protobuf, configured by the standard variables."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if not endpoint:
            base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or DEFAULT_ENDPOINT
            endpoint = base.rstrip("/") + TRACES_PATH
        self.endpoint = endpoint
        timeout = _env(environ, "TIMEOUT") or str(DEFAULT_TIMEOUT_MS)
        try:
            self.timeout_s = float(timeout) / 1000
        except ValueError:
            raise OtlpConfigError(f"OTLP timeout {timeout!r} is not a number") from None
        if self.timeout_s <= 0:
            raise OtlpConfigError("OTLP timeout must be > 0")
        compression = (_env(environ, "COMPRESSION") or "none").lower()
        if compression not in ("none", "gzip"):
            raise OtlpConfigError(f"OTLP compression must be gzip or none, not {compression!r}")
        self.compression = compression
        self.headers = {
            **parse_headers(_env(environ, "HEADERS")),
            "content-type": "application/x-protobuf",
        }
        if compression == "gzip":
            self.headers["content-encoding"] = "gzip"
        certificate = _env(environ, "CERTIFICATE")
        self._client = httpx.Client(verify=certificate or True, timeout=self.timeout_s)
        self._is_shutdown = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._is_shutdown:
            return SpanExportResult.FAILURE
        try:
            body = encode_spans(spans)
        except Exception:
            log.exception("could not encode %d spans", len(spans))
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS if self.post(body, len(spans)) else SpanExportResult.FAILURE

    def post(self, body: bytes, num_spans: int) -> bool:
        """Send one encoded ExportTraceServiceRequest; False if it could not be delivered."""
        if self._is_shutdown:
            return False
        if self.compression == "gzip":
            body = gzip.compress(body, compresslevel=6)
        deadline = time.monotonic() + self.timeout_s
        delay_s = 0.5
        while True:
            try:
                response = self._client.post(self.endpoint, content=body, headers=self.headers)
                if response.is_success:
                    return True
                if response.status_code not in RETRYABLE_STATUS:
                    log.warning("OTLP export refused: %d %s", response.status_code, response.text)
                    return False
                problem = f"status {response.status_code}"
            except httpx.HTTPError as exc:
                problem = repr(exc)
            wait_s = delay_s * random.uniform(0.8, 1.2)
            if self._is_shutdown or time.monotonic() + wait_s >= deadline:
                log.warning("OTLP export of %d spans failed: %s", num_spans, problem)
                return False
            time.sleep(wait_s)
            delay_s *= 2

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._is_shutdown = True
        self._client.close()
