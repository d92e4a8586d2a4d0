"""Usage: the choices of a request, and prompts never served are not billed.

usage_records.num_choices: how many choices (`n`) a request asked for, and
longest_choice_tokens: the output tokens of its longest choice (NULL with one choice). A
request with n choices runs n sequences side by side, and its completion_tokens are the
sum over them. Its time per output token is that of its longest choice, which spans its
E2E: (E2E - TTFT) / (longest_choice_tokens - 1). Divided by every choice's tokens, an
n = 4 request would read four times faster than it ran and meet TPOT SLOs it missed.
Rows written before this revision asked for one choice: the only kind served then.

input_tokens in usage_hourly counted the prompt of every request not refused, including
requests that never left the queue (their client went away, or they failed, while
queued; queue_wait_ms is NULL): tenants were billed for prompts nothing processed. From
this revision on they are not (gateway.observability.slo.is_prompt_served); the upgrade
takes those prompts out of the hours already summed, the downgrade puts them back.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The tables as this revision knows them (not the application's models, which move on).
_usage = sa.table(
    "usage_records",
    sa.column("tenant_id", sa.String),
    sa.column("tier", sa.String),
    sa.column("outcome", sa.String),
    sa.column("prompt_tokens", sa.Integer),
    sa.column("queue_wait_ms", sa.Float),
    sa.column("created_at", sa.DateTime(timezone=True)),
)
_hourly = sa.table(
    "usage_hourly",
    sa.column("hour", sa.DateTime(timezone=True)),
    sa.column("tenant_id", sa.String),
    sa.column("tier", sa.String),
    sa.column("input_tokens", sa.BigInteger),
)


def _hour(dialect: str) -> sa.ColumnElement:
    # As migration 0005 keys the rollup's hours (and the writer after it).
    created = _usage.c.created_at
    if dialect == "sqlite":
        return sa.func.strftime("%Y-%m-%d %H:00:00.000000", created)
    return sa.func.timezone("UTC", sa.func.date_trunc("hour", sa.func.timezone("UTC", created)))


def _shift_unserved_prompts(sign: int) -> None:
    """Add sign x (prompt tokens of requests admitted but never out of the queue) to the
    input_tokens of their hours."""
    u, h = _usage, _hourly
    unserved = (
        sa.select(
            _hour(op.get_bind().dialect.name).label("hour"),
            u.c.tenant_id,
            u.c.tier,
            sa.func.sum(u.c.prompt_tokens).label("tokens"),
        )
        .where(u.c.queue_wait_ms.is_(None), ~u.c.outcome.like("rejected:%"))
        .group_by(sa.literal_column("hour"), u.c.tenant_id, u.c.tier)
        .subquery()
    )
    op.execute(
        sa.update(h)
        .where(
            h.c.hour == unserved.c.hour,
            h.c.tenant_id == unserved.c.tenant_id,
            h.c.tier == unserved.c.tier,
        )
        .values(input_tokens=h.c.input_tokens + sign * unserved.c.tokens)
    )


def upgrade() -> None:
    op.add_column(
        "usage_records",
        sa.Column("num_choices", sa.SmallInteger(), nullable=False, server_default="1"),
    )
    op.add_column("usage_records", sa.Column("longest_choice_tokens", sa.Integer()))
    _shift_unserved_prompts(-1)


def downgrade() -> None:
    _shift_unserved_prompts(+1)
    # ALTER TABLE ... DROP COLUMN, as in 0006 (SQLite 3.35+ has it).
    op.drop_column("usage_records", "longest_choice_tokens")
    op.drop_column("usage_records", "num_choices")
