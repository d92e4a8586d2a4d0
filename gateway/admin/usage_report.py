"""Usage and cost per tenant and tier over a time range, grouped by hour or day.

The sums come from the hourly rollup usage_hourly for the whole UTC hours of the range
and from usage_records only for the partial hours at its edges (migration 0005); the
result is identical to summing usage_records over the whole range
(`usage_report_from_records`, the reference). A row counts:

- requests: every request recorded (offered load: served, failed, aborted, refused),
  but those that ended as the client's own mistake (outcome "invalid:<code>": bad
  input, unknown model, a tier the key may not use), which usage_records keeps;
- refusals: those refused at admission (outcome "rejected:<code>");
- aborted: those whose client went away before the answer (outcome "aborted"), reported
  so that slo_attainment can be recomputed from the row (slo_met / (requests - aborted))
  and the row reconciled with /metrics' outcome="aborted";
- input_tokens: prompt tokens of the requests admitted and served (not refused, and
  out of the queue: a request whose client left while it was queued ran nothing);
- output_tokens: tokens generated;
- slo_met / slo_attainment: requests that completed within the tier's TTFT and TPOT SLO
  (TPOT = (E2E - TTFT) / (output tokens per choice - 1)), over requests minus aborted ones (a
  client that went away did not wait for an answer). Refusals count as misses. Whether
  a request met its SLO is decided once, against the SLOs its tier had when it ran
  (usage_records.slo_met; /metrics counts by the same), so changing a tier's SLO does
  not rewrite history, even of requests whose records are still being written, and a
  sum per hour can hold it;
- cost: each request's input and output tokens at the prices per million tokens its tier
  had when it ran (usage_records.cost_nanos, migration 0008): changing a tier's prices, or
  deleting the tier, does not re-price history.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import BigInteger, Select, case, cast, func, literal, select, text, union_all
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from gateway.db.models import UsageHourly, UsageRow
from gateway.usage import (
    ROLLUP_COUNTS,
    billed_tokens_sql,
    hour_of,
    saturated_sum_sql,
    summed_sql,
)

GROUPINGS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
_WORK_MEM = "64MB"
_SQLITE_FORMATS = {"hour": "%Y-%m-%d %H:00:00", "day": "%Y-%m-%d 00:00:00"}


@dataclass(frozen=True)
class UsageQuery:
    """The range [start, end) (aware UTC), the grouping, and optional filters."""

    start: datetime
    end: datetime
    group_by: str = "hour"
    tenant_id: str | None = None
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class UsageLine:
    """One (period, tenant, tier) of the report."""

    period_start: datetime
    tenant_id: str
    tier: str
    requests: int
    refusals: int
    aborted: int
    input_tokens: int
    output_tokens: int
    slo_met: int
    cost: float

    @property
    def slo_attainment(self) -> float | None:
        counted = self.requests - self.aborted
        return self.slo_met / counted if counted else None

    def as_dict(self) -> dict[str, object]:
        return {
            "period_start": self.period_start.isoformat(),
            "tenant_id": self.tenant_id,
            "tier": self.tier,
            "requests": self.requests,
            "refusals": self.refusals,
            "aborted": self.aborted,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "slo_met": self.slo_met,
            "slo_attainment": self.slo_attainment,
            "cost": round(self.cost, 9),
        }


def _period(dialect: str, group_by: str, at: ColumnElement) -> ColumnElement:
    if dialect == "sqlite":
        # Stored as naive UTC text: truncating the text is truncating the time.
        return func.strftime(_SQLITE_FORMATS[group_by], at)
    return func.date_trunc(group_by, func.timezone("UTC", at))


def _filtered(statement: Select, tenant_id: ColumnElement, tier: ColumnElement, query: UsageQuery):
    if query.tenant_id is not None:
        statement = statement.where(tenant_id == query.tenant_id)
    if query.tier is not None:
        statement = statement.where(tier == query.tier)
    return statement


def _from_records(dialect: str, query: UsageQuery, start: datetime, end: datetime) -> Select:
    """The usage_records rows in [start, end) as counts, one row each."""
    u = UsageRow
    refused = u.outcome.like("rejected:%")

    def one_if(condition: ColumnElement) -> ColumnElement:
        return case((condition, 1), else_=0)

    input_tokens, output_tokens = billed_tokens_sql(u)
    statement = select(
        _period(dialect, query.group_by, u.created_at).label("period"),
        u.tenant_id,
        u.tier,
        literal(1, BigInteger).label("requests"),
        one_if(refused).label("refusals"),
        one_if(u.outcome == "aborted").label("aborted"),
        input_tokens.label("input_tokens"),
        output_tokens.label("output_tokens"),
        one_if(u.slo_met).label("slo_met"),
        func.coalesce(u.cost_nanos, 0).label("cost_nanos"),
    ).where(u.created_at >= start, u.created_at < end, summed_sql(u))
    return _filtered(statement, u.tenant_id, u.tier, query)


def _from_rollup(dialect: str, query: UsageQuery, start: datetime, end: datetime) -> Select:
    """The usage_hourly rows of the whole hours in [start, end)."""
    h = UsageHourly
    statement = select(
        _period(dialect, query.group_by, h.hour).label("period"),
        h.tenant_id,
        h.tier,
        *(h.__table__.c[name] for name in ROLLUP_COUNTS),
    ).where(h.hour >= start, h.hour < end)
    return _filtered(statement, h.tenant_id, h.tier, query)


def _whole_hours(start: datetime, end: datetime) -> tuple[datetime, datetime] | None:
    """The first and the end of the whole UTC hours in [start, end), if there are any."""
    first = hour_of(start)
    if first < start:
        first += timedelta(hours=1)
    last = hour_of(end)
    return (first, last) if first < last else None


def _parts(dialect: str, query: UsageQuery, *, is_rollup_used: bool) -> list[Select]:
    whole = _whole_hours(query.start, query.end) if is_rollup_used else None
    if whole is None:
        return [_from_records(dialect, query, query.start, query.end)]
    first, last = whole
    parts = [_from_rollup(dialect, query, first, last)]
    if query.start < first:
        parts.append(_from_records(dialect, query, query.start, first))
    if last < query.end:
        parts.append(_from_records(dialect, query, last, query.end))
    return parts


def report_statement(dialect: str, query: UsageQuery, *, is_rollup_used: bool = True) -> Select:
    """The report's one SELECT for `dialect` ("sqlite" or "postgresql")."""
    parts = _parts(dialect, query, is_rollup_used=is_rollup_used)
    # One aggregation over the rollup rows and the edge records together (summing each
    # part first and then the sums would sort the rollup rows twice).
    sums = (parts[0] if len(parts) == 1 else union_all(*parts)).subquery("sums")
    return (
        select(
            sums.c.period,
            sums.c.tenant_id,
            sums.c.tier,
            # BIGINT, not PostgreSQL's NUMERIC for a sum of BIGINT (slow to decode); the
            # cost at the column's most, as the rollup holds it, where its sum would pass it.
            *(
                (
                    saturated_sum_sql(sums.c[name])
                    if name == "cost_nanos"
                    else cast(func.sum(sums.c[name]), BigInteger)
                ).label(name)
                for name in ROLLUP_COUNTS
            ),
        )
        .select_from(sums)
        .group_by(sums.c.period, sums.c.tenant_id, sums.c.tier)
        .order_by(sums.c.period, sums.c.tenant_id, sums.c.tier)
    )


async def _report(
    sessionmaker: async_sessionmaker, query: UsageQuery, *, is_rollup_used: bool
) -> list[UsageLine]:
    async with sessionmaker() as session:
        # Core rows, not the ORM's: a year by hour is hundreds of thousands of lines.
        connection = await session.connection()
        dialect = connection.dialect.name
        if dialect == "postgresql":
            # Room to hash-aggregate in memory; the default 4 MB makes PostgreSQL sort
            # the rollup rows on disk. LOCAL: for this read-only transaction only.
            await connection.execute(text(f"SET LOCAL work_mem = '{_WORK_MEM}'"))
        statement = report_statement(dialect, query, is_rollup_used=is_rollup_used)
        rows = (await connection.execute(statement)).all()
    return [_line(*row) for row in rows]


async def usage_report(sessionmaker: async_sessionmaker, query: UsageQuery) -> list[UsageLine]:
    """The report's lines, oldest period first, then by tenant and tier."""
    return await _report(sessionmaker, query, is_rollup_used=True)


async def usage_report_from_records(
    sessionmaker: async_sessionmaker, query: UsageQuery
) -> list[UsageLine]:
    """The same report summed from usage_records alone: the reference the rollup must
    equal, and what /admin/v1/usage cost before it (tests and the benchmark use it)."""
    return await _report(sessionmaker, query, is_rollup_used=False)


def _line(
    period: datetime | str,
    tenant_id: str,
    tier: str,
    requests: int,
    refusals: int | None,
    aborted: int | None,
    input_tokens: int | None,
    output_tokens: int | None,
    slo_met: int | None,
    cost_nanos: int | None,
) -> UsageLine:
    if isinstance(period, str):
        period = datetime.fromisoformat(period)
    period = period.replace(tzinfo=UTC) if period.tzinfo is None else period.astimezone(UTC)
    input_tokens, output_tokens = int(input_tokens or 0), int(output_tokens or 0)
    return UsageLine(
        period_start=period,
        tenant_id=tenant_id,
        tier=tier,
        requests=int(requests),
        refusals=int(refusals or 0),
        aborted=int(aborted or 0),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        slo_met=int(slo_met or 0),
        cost=int(cost_nanos or 0) / 1e9,
    )
