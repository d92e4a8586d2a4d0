"""Typed gateway errors and the one table that maps every error to an HTTP response.

Lower layers raise their own typed exceptions (engine.errors, scheduler errors); they
carry data, never status codes. `error_response` turns any exception into the OpenAI
error shape `{"error": {"message", "type", "param", "code"}}`; anything unmapped is a
logged 500.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import exc as sa_exc
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from engine import errors as engine_errors
from scheduler import admission as scheduler_admission
from scheduler import backend as scheduler_queue
from scheduler import rate_limit as scheduler_limits
from scheduler import results as scheduler_results

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base of errors raised by the gateway itself."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        # Response headers the status needs to be complete (Allow on a 405,
        # Accept-Encoding on a 415, the rate-limit headers on a 429).
        self.headers = dict(headers or {})


class InvalidRequestError(GatewayError):
    """The request body or parameters are invalid (400)."""


class AuthenticationError(GatewayError):
    """Missing, malformed, unknown, revoked or expired credentials (401)."""


class PermissionDeniedError(GatewayError):
    """Authenticated, but not allowed: tenant suspended, tier not allowed (403)."""


class NotFoundError(GatewayError):
    """Unknown object, or another tenant's object (404, never 403)."""


class ConflictError(GatewayError):
    """The change conflicts with existing state, e.g. deleting a tier in use (409)."""


class PayloadTooLargeError(GatewayError):
    """Request body over the configured limit (413)."""


class UnsupportedMediaTypeError(GatewayError):
    """The body is in a form the gateway does not read, e.g. compressed (415)."""


class RateLimitedError(GatewayError):
    """'Not now' (429): rate limit, concurrency limit, SLO unattainable, queue timeout.

    retry_after_s is the real expected wait; `code` says which limit.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, code=code, headers=headers)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(GatewayError):
    """No capacity at all: no live worker, backend down (503)."""


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    code: str | None = None


# The one table: exception class -> HTTP status, OpenAI error type, default code.
# Looked up along the MRO, so subclasses inherit their parent's row.
ERROR_TABLE: dict[type[BaseException], ErrorKind] = {
    InvalidRequestError: ErrorKind(400, "invalid_request_error"),
    AuthenticationError: ErrorKind(401, "authentication_error", "invalid_api_key"),
    PermissionDeniedError: ErrorKind(403, "permission_error"),
    NotFoundError: ErrorKind(404, "not_found_error"),
    ConflictError: ErrorKind(409, "conflict_error"),
    PayloadTooLargeError: ErrorKind(413, "invalid_request_error", "request_too_large"),
    UnsupportedMediaTypeError: ErrorKind(415, "invalid_request_error", "unsupported_media_type"),
    RateLimitedError: ErrorKind(429, "rate_limit_error"),
    ServiceUnavailableError: ErrorKind(503, "service_unavailable_error"),
    engine_errors.ContextLengthExceededError: ErrorKind(
        400, "invalid_request_error", "context_length_exceeded"
    ),
    engine_errors.PromptTooLongError: ErrorKind(
        400, "invalid_request_error", "context_length_exceeded"
    ),
    engine_errors.InvalidRequestError: ErrorKind(400, "invalid_request_error"),
    engine_errors.EngineDeadError: ErrorKind(503, "service_unavailable_error", "engine_dead"),
    # The scheduler's refusals ("not now" is 429, "cannot at all" is 503). The admission
    # path converts most of them to RateLimitedError with headers; these rows cover the
    # rest (batch lines, errors that surface from a result stream).
    scheduler_limits.RateLimitExceededError: ErrorKind(
        429, "rate_limit_error", "rate_limit_exceeded"
    ),
    scheduler_limits.RequestExceedsLimitError: ErrorKind(
        400, "invalid_request_error", "exceeds_token_limit"
    ),
    scheduler_queue.SloUnattainableError: ErrorKind(429, "rate_limit_error", "slo_unattainable"),
    scheduler_queue.QueueFullError: ErrorKind(429, "rate_limit_error", "queue_full"),
    scheduler_results.QueueTimeoutError: ErrorKind(429, "rate_limit_error", "queue_timeout"),
    scheduler_admission.NoCapacityError: ErrorKind(503, "service_unavailable_error", "no_capacity"),
    scheduler_queue.BackendUnavailableError: ErrorKind(
        503, "service_unavailable_error", "queue_unavailable"
    ),
    scheduler_queue.UnknownTierError: ErrorKind(
        503, "service_unavailable_error", "tier_not_configured"
    ),
    scheduler_results.JobInvalidError: ErrorKind(400, "invalid_request_error", "invalid_request"),
    scheduler_results.JobFailedError: ErrorKind(500, "server_error", "engine_error"),
}


def register_error(exc_type: type[BaseException], kind: ErrorKind) -> None:
    """Add a row for an error class defined in another module of the gateway."""
    ERROR_TABLE[exc_type] = kind


# The database unreachable (down, restarting, dropped, its pool exhausted): "cannot at
# all, for now", as a queue that cannot be reached. Other database errors (a constraint,
# a bad statement) are bugs, left to the logged 500.
DATABASE_UNAVAILABLE = ErrorKind(503, "service_unavailable_error", "database_unavailable")


def _is_database_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.TimeoutError):  # no pooled connection came free in time
        return True
    if not isinstance(exc, sa_exc.DBAPIError):
        return False
    # No statement: it failed while connecting.
    return (
        isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError)
        or exc.connection_invalidated
        or exc.statement is None
    )


def _lookup(exc: BaseException) -> ErrorKind | None:
    if _is_database_unavailable(exc):
        return DATABASE_UNAVAILABLE
    for klass in type(exc).__mro__:
        kind = ERROR_TABLE.get(klass)
        if kind is not None:
            return kind
    return None


# nginx's "client closed request": the client left before its answer (never sent).
CLIENT_CLOSED_REQUEST = 499


def error_status(exc: BaseException) -> int:
    """The status `error_response` answers `exc` with (CLIENT_CLOSED_REQUEST for a
    client that left while its body was read), without logging anything."""
    if isinstance(exc, ClientDisconnect):
        return CLIENT_CLOSED_REQUEST
    kind = _lookup(exc)
    return 500 if kind is None else kind.status


def unserved_outcome(exc: BaseException) -> str:
    """The usage outcome of a request that ended with `exc` before it was admitted:
    "invalid:<code>" for the client's own mistake (a 4xx other than 429: bad input, an
    unknown model, a tier it may not use), which says nothing of the service and stays
    out of its tier's SLO attainment and refusals; "rejected:<code>" for a refusal
    (429 not now, 503 no capacity) or a failure of ours. Counted as refusals, one
    tenant's malformed requests took a tier's reported attainment down to 43%."""
    status = error_status(exc)
    kind = "invalid" if 400 <= status < 500 and status != 429 else "rejected"
    return f"{kind}:{error_code(exc)}"


def error_code(exc: BaseException) -> str:
    """The short code a usage record or a log line names an error by."""
    kind = _lookup(exc)
    if kind is None:
        return "server_error"
    if kind is DATABASE_UNAVAILABLE:  # SQLAlchemy's own `code` is a docs anchor
        return kind.code or kind.type
    return getattr(exc, "code", None) or kind.code or kind.type


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: BaseException, *, request_id: str | None = None) -> JSONResponse:
    kind = _lookup(exc)
    headers: dict[str, str] = {}
    if request_id:
        headers["x-request-id"] = request_id
    if kind is None:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(
            error_body("Internal server error", "server_error", None, None),
            status_code=500,
            headers=headers,
        )
    if kind is DATABASE_UNAVAILABLE:
        # The driver's text names hosts and databases: logged here, not sent.
        log.warning("the database is unreachable: %s", exc)
        return JSONResponse(
            error_body(
                "The database is unreachable; try again shortly.",
                kind.type,
                None,
                kind.code,
            ),
            status_code=kind.status,
            headers=headers,
        )
    message = getattr(exc, "message", None) or str(exc)
    if type(exc) is scheduler_results.JobFailedError:
        # A worker's unexpected exception, as repr() (its text, paths, tensor shapes):
        # the worker logged it with its traceback; the client is told only that it failed.
        log.warning("a job failed on its worker: %s", message)
        message = "The server failed while generating this response."
    param = getattr(exc, "param", None)
    code = getattr(exc, "code", None) or kind.code
    retry_after_s = getattr(exc, "retry_after_s", None)
    if getattr(exc, "retry_after_ms", None) is not None:
        retry_after_s = exc.retry_after_ms / 1000.0  # type: ignore[attr-defined]
    if isinstance(exc, GatewayError):
        headers.update(getattr(exc, "headers", None) or {})
    if kind.status == 429 and retry_after_s is not None:
        # Retry-After is whole seconds (rounded up so honouring it is enough);
        # retry-after-ms carries the precise wait.
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(retry_after_s * 1000)))
    return JSONResponse(
        error_body(message, kind.type, param, code), status_code=kind.status, headers=headers
    )
