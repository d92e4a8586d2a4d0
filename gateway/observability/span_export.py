"""Span export in a process of its own.

The gateway's request path is bound to one interpreter lock: an exporter thread that
builds, encodes and posts spans takes the lock from the event loop for all of that
time, and at six spans a request the loop then served a fifth fewer requests. So the
gateway only gathers one plain tuple per request (a `TraceRecord`: the root and the
timeline) and, a batch at a time, pickles them into a datagram to a child process
(`main` below), which cuts them into spans, encodes them and posts them over OTLP/HTTP
on another core. The child reads the same OTEL_EXPORTER_OTLP_* variables.

The child runs at a lower CPU priority (EXPORT_NICENESS): on a machine whose cores the
gateway keeps busy, exporting is what waits, not serving. It needs a few percent of a
core, which it still gets.

A datagram socket pair, non-blocking on the gateway's side: a batch goes whole or not
at all, and a child that falls behind costs dropped spans (counted, as the SDK's batch
processor drops them when its queue is full), never a blocked event loop. The child
exits when the gateway closes its end or dies.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from gateway.observability.logs import configure_logging
from gateway.observability.otlp import OtlpHttpSpanExporter, encode_records
from gateway.observability.tracing import MAX_SPANS_PER_REQUEST, spans_of

log = logging.getLogger(__name__)

MAX_DATAGRAM_BYTES = 60_000  # well under the socket buffer; a bigger batch is split
SOCKET_BUFFER_BYTES = 4 * 2**20
DROP_WARNING_INTERVAL_S = 10.0
MAX_REQUESTS_PER_POST = 1024  # what the child gathers into one export request
EXPORT_NICENESS = 10  # added to the child's nice value: about a tenth of a busy core's share
_END = b"end"  # the gateway's last datagram: export what is left, then exit
# The child ignores SIGINT, first thing: a terminal's ^C goes to the whole process group,
# and the gateway, which owns shutdown, sends _END once it has flushed (killed by the ^C,
# the child printed a KeyboardInterrupt traceback and its spans were lost).
_CHILD = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "import sys; from gateway.observability.span_export import main; sys.exit(main())"
)


def _float_env(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(environ.get(name, "") or default)
    except ValueError:
        return default


class ProcessSpanSink:
    """Gathers span records on the gateway's side and ships them to the export process.

    `add` is called on the event loop, once per request, and costs a list append; a
    batch is pickled and sent once it holds `batch_size` requests, and a flusher thread
    sends what is waiting every `schedule_delay_s` (OTEL_BSP_SCHEDULE_DELAY, in
    milliseconds, as the SDK reads it). OTEL_BSP_MAX_EXPORT_BATCH_SIZE counts spans, as
    in the SDK; a request is up to MAX_SPANS_PER_REQUEST of them.
    """

    def __init__(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        environ = dict(os.environ if environ is None else environ)
        self.schedule_delay_s = _float_env(environ, "OTEL_BSP_SCHEDULE_DELAY", 1000) / 1000
        max_spans = int(_float_env(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
        self.batch_size = max(1, max_spans // MAX_SPANS_PER_REQUEST)
        self.num_dropped = 0
        self._warned_at_s = float("-inf")
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        for sock in (parent, child):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        parent.setblocking(False)
        self._sock = parent
        header = pickle.dumps(
            (dict(resource.attributes), resource.schema_url, scope.name, scope.version)
        )
        try:
            self._process = subprocess.Popen(
                # -c, not -m: the package imports this module, which -m would run twice.
                [sys.executable, "-c", _CHILD, str(child.fileno())],
                pass_fds=(child.fileno(),),
                env=environ,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._send(header)
        self._flusher = threading.Thread(
            target=self._flush_every, name="tiergate-span-flush", daemon=True
        )
        self._flusher.start()

    def add(self, record: tuple) -> None:
        """One request's `TraceRecord`, as a plain tuple."""
        # Under the lock: the flusher thread swaps the list out, and a record added to
        # the list it took (after it pickled them) would be lost.
        with self._lock:
            self._pending.append(record)
            is_full = len(self._pending) >= self.batch_size
        if is_full:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self._ship(batch)

    def _ship(self, batch: list[tuple]) -> None:
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_DATAGRAM_BYTES and len(batch) > 1:
            half = len(batch) // 2
            self._ship(batch[:half])
            self._ship(batch[half:])
            return
        if not self._send(data):
            self.num_dropped += len(batch)  # requests' span trees
            now_s = time.monotonic()
            if now_s - self._warned_at_s >= DROP_WARNING_INTERVAL_S:  # a line, not a flood
                self._warned_at_s = now_s
                log.warning(
                    "span export is behind: the spans of %d requests dropped so far",
                    self.num_dropped,
                )

    def _send(self, data: bytes) -> bool:
        try:
            self._sock.send(data)
        except (BlockingIOError, OSError):
            return False
        return True

    def _flush_every(self) -> None:
        while not self._closed.wait(self.schedule_delay_s):
            try:
                self.flush()
            except Exception:  # the flusher must outlive one bad batch
                log.exception("span flush failed")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Send what is waiting, let the child export it, and stop it."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._flusher.join(timeout_s)
        self.flush()
        deadline = time.monotonic() + timeout_s
        # Offered again while the child drains a full buffer; a child that is gone will
        # never take it (the gateway waited out the whole deadline for one).
        while not self._send(_END) and self._process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self._process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("span export process did not finish in %.0f s; stopped", timeout_s)
            self._process.kill()
            self._process.wait()
        self._sock.close()


def _serve(sock: socket.socket, exporter: OtlpHttpSpanExporter) -> None:
    attributes, schema_url, scope_name, scope_version = pickle.loads(
        sock.recv(MAX_DATAGRAM_BYTES * 2)
    )
    resource = Resource(attributes, schema_url)
    scope = InstrumentationScope(scope_name, scope_version)
    parent = os.getppid()
    sock.settimeout(1.0)
    while True:
        try:
            data = sock.recv(MAX_DATAGRAM_BYTES * 2)
        except TimeoutError:
            if os.getppid() != parent:
                return  # the gateway died without saying goodbye
            continue
        if not data or data == _END:
            return
        records: list[Any] = pickle.loads(data)
        # Everything already waiting goes out in the same request.
        sock.setblocking(False)
        try:
            while len(records) < MAX_REQUESTS_PER_POST:
                more = sock.recv(MAX_DATAGRAM_BYTES * 2)
                if more == _END or not more:
                    _post(exporter, resource, scope, records)
                    return
                records.extend(pickle.loads(more))
        except BlockingIOError:
            pass
        finally:
            sock.settimeout(1.0)
        _post(exporter, resource, scope, records)


def _post(
    exporter: OtlpHttpSpanExporter,
    resource: Resource,
    scope: InstrumentationScope,
    records: list[Any],
) -> None:
    try:
        spans = [span for record in records for span in spans_of(record)]
        exporter.post(encode_records(resource, scope, spans), len(spans))
    except Exception:
        log.exception("could not export the spans of %d requests", len(records))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # As the gateway logs: JSON lines into the same stream, unless it is a terminal.
    configure_logging(logging.WARNING, is_json=not sys.stderr.isatty())
    try:
        os.nice(EXPORT_NICENESS)
    except OSError as exc:  # not allowed here: export at the gateway's priority
        log.warning("could not lower the export process's priority (%s)", exc)
    sock = socket.socket(fileno=int(argv[0]))
    exporter = OtlpHttpSpanExporter()
    try:
        _serve(sock, exporter)
    finally:
        exporter.shutdown()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
