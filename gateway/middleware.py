"""The gateway's outermost ASGI layer: request ids, the body size limit, the error boundary.

It also refuses a compressed request body (Content-Encoding other than identity) with a
415 before a byte of it is read: every route that reads a body would otherwise try to
parse the compressed bytes and answer a misleading 400 (invalid UTF-8, bad multipart).

One pure-ASGI middleware rather than several `BaseHTTPMiddleware`s: it adds nothing to a
streaming response's path but a header, and it is the single place where an exception
that escaped a route becomes an OpenAI-shaped error (so even a 500 carries x-request-id).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import (
    CLIENT_CLOSED_REQUEST,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    error_response,
)

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
RESPONSE_STATUS_KEY = "response_status"  # in scope["state"], for the layers inside


def new_request_id() -> str:
    """A fresh request id; also the job id the queue and the engine know the request by.

    128 random bits, as a uuid4 carries (without building the UUID object)."""
    return f"req_{os.urandom(16).hex()}"


def request_id_of(scope: Scope) -> str:
    """The id the middleware assigned to this request."""
    return scope["state"]["request_id"]


def response_status_of(scope: Scope) -> int | None:
    """The status code of the response once it started (None before)."""
    return scope["state"].get(RESPONSE_STATUS_KEY)


class GatewayMiddleware:
    """Assigns x-request-id, enforces max_body_bytes (413), turns escaped errors into JSON.

    `upload_limits` gives paths that take file uploads (POST /v1/files) their own limit.
    """

    def __init__(
        self, app: ASGIApp, *, max_body_bytes: int, upload_limits: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.upload_limits = dict(upload_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        # A new dict: the server shares the lifespan state between requests by copy, and
        # an in-process client may share it outright.
        state = scope["state"] = {**scope.get("state", {}), "request_id": request_id}
        header_value = request_id.encode("ascii")
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
                state[RESPONSE_STATUS_KEY] = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER, header_value))
                message = {**message, "headers": headers}
            await send(message)

        try:
            limit = self.upload_limits.get(scope.get("path", ""), self.max_body_bytes)
            declared = _content_length(scope)
            if _has_body(scope, declared):
                codings = _content_codings(scope)
                if codings:
                    raise _unsupported_encoding(codings)
            if declared is not None and declared > limit:
                raise _too_large(limit)
            await self.app(scope, self._limited(receive, limit), send_with_id)
        except ClientDisconnect:
            # The client left before its body arrived: nobody to answer, nothing failed
            # here. Recorded as 499 (nginx's "client closed request"), not logged as an
            # error.
            state[RESPONSE_STATUS_KEY] = CLIENT_CLOSED_REQUEST
        except Exception as exc:
            if response_started:
                # Too late for a status code; the server closes the connection.
                log.exception("error after the response started (request %s)", request_id)
                return
            response = error_response(exc, request_id=request_id)
            await response(scope, receive, send)

    def _limited(self, receive: Receive, limit: int) -> Receive:
        """Wrap receive so a body without (or lying about) content-length is still capped."""
        num_bytes = 0

        async def receive_limited() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit:
                    raise _too_large(limit)
            return message

        return receive_limited


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _has_body(scope: Scope, declared: int | None) -> bool:
    """Whether the request carries a body: a Content-Encoding on a body-less request
    (a GET from a client that sets it everywhere) describes nothing, so it is let be."""
    if declared is not None:
        return declared > 0
    return any(name == b"transfer-encoding" for name, _ in scope.get("headers", []))


def _content_codings(scope: Scope) -> list[str]:
    """The content codings applied to the body, identity left out (RFC 9110 8.4: a list,
    possibly over several header lines, case-insensitive)."""
    codings: list[str] = []
    for name, value in scope.get("headers", []):
        if name == b"content-encoding":
            for coding in value.decode("latin-1").split(","):
                coding = coding.strip().lower()
                if coding and coding != "identity":
                    codings.append(coding)
    return codings


def _unsupported_encoding(codings: list[str]) -> UnsupportedMediaTypeError:
    named = ", ".join(codings)
    if len(named) > 100:  # the header is the client's: echo a bounded part of it
        named = named[:100] + "..."
    return UnsupportedMediaTypeError(
        f"Content-Encoding {named} is not supported: send the request body uncompressed.",
        code="unsupported_content_encoding",
        # RFC 9110 15.5.16: a 415 for a content coding says which codings are accepted.
        headers={"accept-encoding": "identity"},
    )


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"Request body is larger than the limit of {limit} bytes.")
