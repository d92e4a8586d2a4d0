"""Structured JSON logs, each line carrying the request id and trace id it belongs to.

The telemetry middleware sets the two context variables for the duration of a request,
so any log call made while serving it (in the route, the auth cache, the usage writer's
caller) is linked to the request's `x-request-id` header and its trace.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

request_id_var: ContextVar[str | None] = ContextVar("tiergate_request_id", default=None)
trace_id_var: ContextVar[str | None] = ContextVar("tiergate_trace_id", default=None)

# LogRecord attributes that are not "extra" fields passed by the caller.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request/trace ids, extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        trace_id = getattr(record, "trace_id", None) or trace_id_var.get()
        if trace_id:
            entry["trace_id"] = trace_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: int | str = logging.INFO, *, is_json: bool = True) -> None:
    """Send the process's logs to stderr, as JSON lines (or plain text for a terminal).

    Called once by the command-line entry point, the process edge; library code only
    creates loggers.
    """
    handler = logging.StreamHandler(sys.stderr)
    if is_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
