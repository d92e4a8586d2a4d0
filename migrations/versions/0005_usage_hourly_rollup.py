"""Hourly usage rollup: usage_records.slo_met and the usage_hourly table, backfilled.

/admin/v1/usage summed every usage_records row of its range; over millions of rows that
takes seconds. usage_hourly holds the same sums per UTC hour, tenant and tier; the
report reads it for whole hours and usage_records only for the partial hours at the
edges of a range.

SLO attainment used to be evaluated at report time against the tier's current SLOs,
which a sum cannot do. Each record now carries `slo_met`, evaluated against the tier's
SLOs when it is written. The upgrade evaluates the existing rows against the tiers as
they stand now (the numbers the report gave until now), then sums every row into
usage_hourly. The definition is gateway.observability.slo's: the request completed
("ok"), TTFT <= ttft_slo_ms, and TPOT = max(0, E2E - TTFT) / (output tokens - 1) <=
tpot_slo_ms when there are two output tokens or more; a limit the tier lacks (or a tier
that no longer exists) is not checked.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

# The tables as this revision knows them (not the application's models, which move on).
_usage = sa.table(
    "usage_records",
    sa.column("tenant_id", sa.String),
    sa.column("tier", sa.String),
    sa.column("outcome", sa.String),
    sa.column("prompt_tokens", sa.Integer),
    sa.column("completion_tokens", sa.Integer),
    sa.column("ttft_ms", sa.Float),
    sa.column("e2e_ms", sa.Float),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("slo_met", sa.Boolean),
)
_tiers = sa.table(
    "tiers",
    sa.column("name", sa.String),
    sa.column("ttft_slo_ms", sa.Float),
    sa.column("tpot_slo_ms", sa.Float),
)
_COUNTS = ("requests", "refusals", "aborted", "input_tokens", "output_tokens", "slo_met")


def _met_condition() -> sa.ColumnElement[bool]:
    u = _usage

    def tier_slo(column: sa.ColumnClause) -> sa.ScalarSelect:
        return sa.select(column).where(_tiers.c.name == u.c.tier).scalar_subquery()

    ttft_slo, tpot_slo = tier_slo(_tiers.c.ttft_slo_ms), tier_slo(_tiers.c.tpot_slo_ms)
    decode_ms = u.c.e2e_ms - u.c.ttft_ms
    # NULLIF: SQL does not promise to stop at `completion_tokens < 2` before dividing.
    tpot = sa.case((decode_ms < 0, 0.0), else_=decode_ms) / sa.func.nullif(
        u.c.completion_tokens - 1, 0
    )
    return sa.and_(
        u.c.outcome == "ok",
        sa.or_(ttft_slo.is_(None), sa.and_(u.c.ttft_ms.is_not(None), u.c.ttft_ms <= ttft_slo)),
        sa.or_(
            tpot_slo.is_(None),
            u.c.ttft_ms.is_(None),
            u.c.completion_tokens < 2,
            tpot <= tpot_slo,
        ),
    )


def _hour(dialect: str) -> sa.ColumnElement:
    created = _usage.c.created_at
    if dialect == "sqlite":
        # The text SQLAlchemy writes for a naive UTC datetime, truncated to the hour, so
        # the writer's later upserts of the same hour hit these rows.
        return sa.func.strftime("%Y-%m-%d %H:00:00.000000", created)
    return sa.func.timezone("UTC", sa.func.date_trunc("hour", sa.func.timezone("UTC", created)))


def _backfill_rollup(dialect: str) -> None:
    u = _usage
    refused = u.c.outcome.like("rejected:%")

    def total_if(condition: sa.ColumnElement[bool], value: sa.ColumnElement | int = 1):
        return sa.func.coalesce(sa.func.sum(sa.case((condition, value), else_=0)), 0)

    hour = _hour(dialect).label("hour")
    sums = sa.select(
        hour,
        u.c.tenant_id,
        u.c.tier,
        sa.func.count(),
        total_if(refused),
        total_if(u.c.outcome == "aborted"),
        total_if(~refused, u.c.prompt_tokens),
        total_if(~refused, u.c.completion_tokens),
        total_if(u.c.slo_met),
    ).group_by(sa.literal_column("hour"), u.c.tenant_id, u.c.tier)
    names = ["hour", "tenant_id", "tier", *_COUNTS]
    rollup = sa.table("usage_hourly", *(sa.column(name) for name in names))
    op.execute(sa.insert(rollup).from_select(names, sums))


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    # Nullable: a gateway still running the previous release during a rolling upgrade
    # writes rows without it (NULL = not evaluated; the rollup repair evaluates them).
    op.add_column("usage_records", sa.Column("slo_met", sa.Boolean(), nullable=True))
    met = sa.case((_met_condition(), sa.true()), else_=sa.false())
    op.execute(sa.update(_usage).values(slo_met=met))
    op.create_table(
        "usage_hourly",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in _COUNTS),
        sa.PrimaryKeyConstraint("hour", "tenant_id", "tier", name="pk_usage_hourly"),
    )
    op.create_index("ix_usage_hourly_tenant_id_hour", "usage_hourly", ["tenant_id", "hour"])
    _backfill_rollup(dialect)


def downgrade() -> None:
    op.drop_index("ix_usage_hourly_tenant_id_hour", table_name="usage_hourly")
    op.drop_table("usage_hourly")
    # SQLite drops a column by copying the table; batch mode does that (and is a plain
    # ALTER TABLE on PostgreSQL).
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("slo_met")
