"""Usage and cost per tenant and tier over a time range, grouped by hour or day.

One aggregate query over usage_records (served by the time index of migration 0004),
joined with the tiers for their SLOs. A row counts:

- requests: every request recorded (offered load: served, failed, aborted, refused);
- refusals: those refused at admission (outcome "rejected:<code>");
- input_tokens, output_tokens: tokens of the requests that were not refused;
- slo_met / slo_attainment: requests that completed within the tier's TTFT and TPOT SLO
  (TPOT = (E2E - TTFT) / (output tokens - 1)), over requests minus aborted ones (a
  client that went away did not wait for an answer). Refusals count as misses. SLOs
  and prices are the tier's current ones;
- cost: input and output tokens at the tier's prices per million tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import and_, case, func, literal_column, or_, select
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.sql.elements import ColumnElement

from gateway.db.models import Tier, UsageRow

GROUPINGS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
_SQLITE_FORMATS = {"hour": "%Y-%m-%d %H:00:00", "day": "%Y-%m-%d 00:00:00"}


@dataclass(frozen=True)
class UsageQuery:
    """The range [start, end) (aware UTC), the grouping, and optional filters."""

    start: datetime
    end: datetime
    group_by: str = "hour"
    tenant_id: str | None = None
    tier: str | None = None


@dataclass(frozen=True)
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
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "slo_met": self.slo_met,
            "slo_attainment": self.slo_attainment,
            "cost": round(self.cost, 9),
        }


def _period(dialect: str, group_by: str) -> ColumnElement:
    created = UsageRow.created_at
    if dialect == "sqlite":
        # Stored as naive UTC text: truncating the text is truncating the time.
        return func.strftime(_SQLITE_FORMATS[group_by], created)
    return func.date_trunc(group_by, func.timezone("UTC", created))


def _slo_met() -> ColumnElement:
    u, t = UsageRow, Tier
    tpot = (u.e2e_ms - u.ttft_ms) / (u.completion_tokens - 1)
    return and_(
        u.outcome == "ok",
        or_(t.ttft_slo_ms.is_(None), u.ttft_ms <= t.ttft_slo_ms),
        or_(t.tpot_slo_ms.is_(None), u.completion_tokens < 2, tpot <= t.tpot_slo_ms),
    )


async def usage_report(sessionmaker: async_sessionmaker, query: UsageQuery) -> list[UsageLine]:
    """The report's lines, oldest period first, then by tenant and tier."""
    u, t = UsageRow, Tier
    async with sessionmaker() as session:
        dialect = session.bind.dialect.name
        period = _period(dialect, query.group_by).label("period")
        refused = u.outcome.like("rejected:%")
        served = ~refused

        def count_if(condition: ColumnElement) -> ColumnElement:
            return func.sum(case((condition, 1), else_=0))

        def sum_if(condition: ColumnElement, value: ColumnElement) -> ColumnElement:
            return func.sum(case((condition, value), else_=0))

        statement = (
            select(
                period,
                u.tenant_id,
                u.tier,
                func.count().label("requests"),
                count_if(refused).label("refusals"),
                count_if(u.outcome == "aborted").label("aborted"),
                sum_if(served, u.prompt_tokens).label("input_tokens"),
                sum_if(served, u.completion_tokens).label("output_tokens"),
                count_if(_slo_met()).label("slo_met"),
                func.max(func.coalesce(t.price_input_per_mtok, 0.0)).label("price_in"),
                func.max(func.coalesce(t.price_output_per_mtok, 0.0)).label("price_out"),
            )
            .select_from(u)
            .outerjoin(t, t.name == u.tier)
            .where(u.created_at >= query.start, u.created_at < query.end)
            .group_by(literal_column("period"), u.tenant_id, u.tier)
            .order_by(literal_column("period"), u.tenant_id, u.tier)
        )
        if query.tenant_id is not None:
            statement = statement.where(u.tenant_id == query.tenant_id)
        if query.tier is not None:
            statement = statement.where(u.tier == query.tier)
        rows = (await session.execute(statement)).all()
    return [_line(row) for row in rows]


def _line(row) -> UsageLine:
    period = row.period
    if isinstance(period, str):
        period = datetime.fromisoformat(period)
    period = period.replace(tzinfo=UTC) if period.tzinfo is None else period.astimezone(UTC)
    input_tokens, output_tokens = int(row.input_tokens or 0), int(row.output_tokens or 0)
    return UsageLine(
        period_start=period,
        tenant_id=row.tenant_id,
        tier=row.tier,
        requests=int(row.requests),
        refusals=int(row.refusals or 0),
        aborted=int(row.aborted or 0),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        slo_met=int(row.slo_met or 0),
        cost=(input_tokens * row.price_in + output_tokens * row.price_out) / 1_000_000,
    )
