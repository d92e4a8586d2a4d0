"""Usage: each request's cost at the prices its tier had when it ran.

usage_records.cost_nanos and usage_hourly.cost_nanos (billionths of the currency, so that
sums are exact in any order): the report priced every hour of history at the
tiers' current prices, joined by name. A price change re-priced every past request, a
deleted tier's requests cost nothing, and a new tier given a deleted one's name re-priced
them again. From this revision on each record carries its cost, priced when it is
written at its tier's prices of the moment the request ran, and the rollup sums it.

The upgrade prices the rows already written at the tiers' prices as they stand now,
which is what the report showed until now (0 for a tier that no longer exists), and the
hours already summed the same way. A record left with a NULL cost_nanos was written by a
gateway older than this revision during a rolling upgrade; rebuild_usage_rollup prices
it as the upgrade does. Billed tokens are gateway.usage.billed_tokens': the prompt of a
request admitted and out of the queue, the output of any request not refused.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The tables as this revision knows them (not the application's models, which move on).
_usage = sa.table(
    "usage_records",
    sa.column("tenant_id", sa.String),
    sa.column("tier", sa.String),
    sa.column("created_at", sa.DateTime(timezone=True)),
    sa.column("outcome", sa.String),
    sa.column("prompt_tokens", sa.Integer),
    sa.column("completion_tokens", sa.Integer),
    sa.column("queue_wait_ms", sa.Float),
    sa.column("cost_nanos", sa.BigInteger),
)
_hourly = sa.table(
    "usage_hourly",
    sa.column("hour", sa.DateTime(timezone=True)),
    sa.column("tenant_id", sa.String),
    sa.column("tier", sa.String),
    sa.column("input_tokens", sa.BigInteger),
    sa.column("output_tokens", sa.BigInteger),
    sa.column("cost_nanos", sa.BigInteger),
)
_tiers = sa.table(
    "tiers",
    sa.column("name", sa.String),
    sa.column("price_input_per_mtok", sa.Float),
    sa.column("price_output_per_mtok", sa.Float),
)


def _price(column: sa.ColumnClause, tier: sa.ColumnElement) -> sa.ColumnElement:
    """The current price of `tier` (0 for a tier that no longer exists)."""
    found = sa.select(column).where(_tiers.c.name == tier).scalar_subquery()
    return sa.func.coalesce(found, 0.0)


def _cost_nanos(input_tokens: sa.ColumnElement, output_tokens: sa.ColumnElement, tier):
    """As gateway.usage.TokenPrices.cost_nanos: the tokens priced, rounded to 1e-9."""
    price_in = _price(_tiers.c.price_input_per_mtok, tier)
    price_out = _price(_tiers.c.price_output_per_mtok, tier)
    nanos = input_tokens * price_in * 1000 + output_tokens * price_out * 1000
    return sa.cast(sa.func.round(nanos), sa.BigInteger)


def _hour(dialect: str) -> sa.ColumnElement:
    # As migration 0005 keys the rollup's hours (and the writer after it).
    created = _usage.c.created_at
    if dialect == "sqlite":
        return sa.func.strftime("%Y-%m-%d %H:00:00.000000", created)
    return sa.func.timezone("UTC", sa.func.date_trunc("hour", sa.func.timezone("UTC", created)))


def upgrade() -> None:
    op.add_column("usage_records", sa.Column("cost_nanos", sa.BigInteger()))
    op.add_column(
        "usage_hourly",
        sa.Column("cost_nanos", sa.BigInteger(), nullable=False, server_default="0"),
    )
    u, h = _usage, _hourly
    refused = u.c.outcome.like("rejected:%")
    served = sa.and_(~refused, u.c.queue_wait_ms.is_not(None))
    served_in = sa.case((served, u.c.prompt_tokens), else_=0)
    served_out = sa.case((~refused, u.c.completion_tokens), else_=0)
    op.execute(sa.update(u).values(cost_nanos=_cost_nanos(served_in, served_out, u.c.tier)))
    # An hour priced as its records were, to the unit, where they are kept; as a whole
    # from its token sums where they are not.
    op.execute(
        sa.update(h).values(cost_nanos=_cost_nanos(h.c.input_tokens, h.c.output_tokens, h.c.tier))
    )
    summed = (
        sa.select(
            _hour(op.get_bind().dialect.name).label("hour"),
            u.c.tenant_id,
            u.c.tier,
            sa.func.sum(u.c.cost_nanos).label("nanos"),
        )
        .where(~u.c.outcome.like("invalid:%"))
        .group_by(sa.literal_column("hour"), u.c.tenant_id, u.c.tier)
        .subquery()
    )
    op.execute(
        sa.update(h)
        .where(
            h.c.hour == summed.c.hour,
            h.c.tenant_id == summed.c.tenant_id,
            h.c.tier == summed.c.tier,
        )
        .values(cost_nanos=summed.c.nanos)
    )


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN, as in 0006 (SQLite 3.35+ has it).
    op.drop_column("usage_hourly", "cost_nanos")
    op.drop_column("usage_records", "cost_nanos")
