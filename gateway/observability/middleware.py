"""The ASGI layer that ties a request's logs and trace to its x-request-id.

It sits just inside GatewayMiddleware (which assigns the id): it sets the logging
context variables for the request and, when tracing, opens the root span before the
route runs and closes it after the last byte is sent.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import error_status
from gateway.middleware import response_status_of
from gateway.observability.logs import request_id_var, trace_id_var
from gateway.observability.telemetry import Telemetry

# Only API calls get a trace; scrapes and probes would drown the interesting ones.
TRACED_PREFIXES = ("/v1/",)


class TelemetryMiddleware:
    """Request id and trace id into the log context; the root span around the call."""

    def __init__(self, app: ASGIApp, *, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = scope.get("state", {}).get("request_id")
        id_token = request_id_var.set(request_id)
        path: str = scope.get("path", "")
        if (
            not self.telemetry.is_tracing
            or request_id is None
            or not path.startswith(TRACED_PREFIXES)
        ):
            try:
                await self.app(scope, receive, send)
            finally:
                request_id_var.reset(id_token)
            return

        traceparent = None
        for name, value in scope["headers"]:
            if name == b"traceparent":
                traceparent = value.decode("latin-1")
                break
        trace_id = self.telemetry.start_request(request_id, scope["method"], path, traceparent)
        trace_token = trace_id_var.set(trace_id)
        status_of_error: int | None = None
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            # The outer middleware turns it into the error table's response; record that.
            status_of_error = error_status(exc)
            raise
        finally:
            # GatewayMiddleware, outside, notes the status as the response starts.
            status_code = response_status_of(scope)
            self.telemetry.end_request(
                request_id, status_of_error if status_code is None else status_code
            )
            trace_id_var.reset(trace_token)
            request_id_var.reset(id_token)
