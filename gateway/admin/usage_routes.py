"""GET /admin/v1/usage: usage and cost per tenant and tier, as JSON or CSV.

Query parameters: `start`, `end` (ISO 8601; default the last 24 hours; a time without
an offset is UTC), `group_by` (`hour` or `day`), `tenant_id`, `tier`, `format`
(`json` or `csv`). Bad values answer 400; a range over `MAX_RANGE` answers 400 too, so
one call cannot ask for years of hourly rows.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.deps import AdminDeps
from gateway.admin.routes import _guarded
from gateway.admin.usage_report import GROUPINGS, UsageLine, UsageQuery, usage_report
from gateway.admin.validation import TENANT_ID, TIER_NAME, in_range_utc
from gateway.errors import InvalidRequestError

DEFAULT_RANGE = timedelta(hours=24)
MAX_RANGE = timedelta(days=400)
CSV_COLUMNS = (
    "period_start",
    "tenant_id",
    "tier",
    "requests",
    "refusals",
    "aborted",
    "input_tokens",
    "output_tokens",
    "slo_met",
    "slo_attainment",
    "cost",
)


def _time(request: Request, name: str, default: datetime) -> datetime:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError:
        raise InvalidRequestError(
            f"{name} must be an ISO 8601 time, such as 2025-01-31T00:00:00Z", param=name
        ) from None
    return in_range_utc(name, value.replace(tzinfo=UTC) if value.tzinfo is None else value)


def parse_usage_query(request: Request) -> tuple[UsageQuery, str]:
    """The typed query and the output format; InvalidRequestError on bad input."""
    params = request.query_params
    end = _time(request, "end", datetime.now(UTC))
    # end is within MIN_YEAR..MAX_YEAR, so a day before it is a valid time.
    start = _time(request, "start", end - DEFAULT_RANGE)
    if start >= end:
        raise InvalidRequestError("start must be before end", param="start")
    if end - start > MAX_RANGE:
        raise InvalidRequestError(
            f"the range may span at most {MAX_RANGE.days} days", param="start"
        )
    group_by = params.get("group_by", "hour")
    if group_by not in GROUPINGS:
        raise InvalidRequestError("group_by must be hour or day", param="group_by")
    fmt = params.get("format", "json")
    if fmt not in ("json", "csv"):
        raise InvalidRequestError("format must be json or csv", param="format")
    tenant_id = params.get("tenant_id") or None
    tier = params.get("tier") or None
    # Shapes the ids are made in: anything else matches no row, and a NUL would reach
    # PostgreSQL as a driver error (a 500) rather than an empty report.
    for name, value, shape in (("tenant_id", tenant_id, TENANT_ID), ("tier", tier, TIER_NAME)):
        if value is not None and not shape.fullmatch(value):
            raise InvalidRequestError(f"{name} is not a valid {name}: {value!r}", param=name)
    return UsageQuery(start, end, group_by, tenant_id, tier), fmt


def render_csv(lines: list[UsageLine]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for line in lines:
        row = line.as_dict()
        row["cost"] = decimal_text(line.cost)
        writer.writerow(["" if row[c] is None else row[c] for c in CSV_COLUMNS])
    return out.getvalue()


def decimal_text(amount: float) -> str:
    """An amount in plain decimals to the billionth, as billing sheets read it (Python
    writes 1.2e-05 for a small float)."""
    text = f"{amount:.9f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def usage_routes(deps: AdminDeps) -> list[BaseRoute]:
    """The usage route, to mount at /admin/v1 next to the other admin routes."""

    async def usage(request: Request) -> Response:
        query, fmt = parse_usage_query(request)
        lines = await usage_report(deps.sessionmaker, query)
        if fmt == "csv":
            name = f"usage-{query.start:%Y%m%dT%H%M}-{query.end:%Y%m%dT%H%M}.csv"
            return Response(
                render_csv(lines),
                media_type="text/csv; charset=utf-8",
                headers={"content-disposition": f'attachment; filename="{name}"'},
            )
        return JSONResponse(
            {
                "object": "usage_report",
                "start": query.start.isoformat(),
                "end": query.end.isoformat(),
                "group_by": query.group_by,
                "data": [line.as_dict() for line in lines],
            }
        )

    return [Route("/usage", _guarded(deps, usage), methods=["GET"])]
