"""The uvicorn settings the serving commands run with: bounds on a request's head.

uvicorn's httptools protocol (the one it picks when httptools is installed, as it is
here) reads a request's head with no bound on its size and no deadline: one client could
send a header of hundreds of megabytes (the parser buffers all of it, more than twice
over), or open connections and send nothing, or a byte now and then, and hold a file
descriptor each until the process runs out of them. All of that before any credential
is read, so anyone who can reach the port could take the gateway down.

`BoundedHttpToolsProtocol` answers a head larger than `MAX_HEAD_BYTES` with 431 and
closes a connection whose head is not complete `HEAD_TIMEOUT_S` after the connection
opened or its request began. The body is the middleware's business (its size limit),
and an idle kept-alive connection uvicorn's own keep-alive timeout's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

# nginx takes heads up to 4 x 8 KiB by default, h11 (uvicorn's other parser) 16 KiB.
MAX_HEAD_BYTES = 64 * 1024
# As nginx's client_header_timeout (60 s) halved: a real client sends its head at once.
HEAD_TIMEOUT_S = 30.0

_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: 35\r\n"
    b"connection: close\r\n"
    b"\r\n"
    b"Request header fields are too large"
)

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: uvicorn's h11 bounds the head size
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


if HttpToolsProtocol is not None:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol with a size limit and a deadline on the head."""

        max_head_bytes = MAX_HEAD_BYTES
        head_timeout_s = HEAD_TIMEOUT_S

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_bytes = 0
            self._in_head = False
            self._ended_in_chunk = False
            self._head_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            # A connection that never sends a byte has no request to time out yet.
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._ended_in_chunk = False
            super().data_received(data)
            # The parser calls on_message_begin / on_headers_complete as it reads `data`:
            # still in a head afterwards, all of `data` counts towards it, unless a
            # request ended in it too (pipelined: most of the chunk may be that request's
            # body; the head's bound then starts with the next chunk).
            if self._in_head and not self._ended_in_chunk and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head_bytes:
                    self._cancel_head_timer()
                    self.transport.write(_431)
                    self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True
            self._head_bytes = 0
            self._arm_head_timer()

        def on_message_complete(self) -> None:
            self._ended_in_chunk = True
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._cancel_head_timer()
            super().on_headers_complete()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()


def uvicorn_config(app: Any, *, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn Config of a serving command, with the bounded head when httptools is
    there (else uvicorn's h11, which bounds the head's size itself)."""
    http: Any = "h11" if HttpToolsProtocol is None else BoundedHttpToolsProtocol
    return uvicorn.Config(app, host=host, port=port, http=http, **kwargs)
