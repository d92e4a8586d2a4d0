"""usage_records.num_choices: how many choices (`n`) a request asked for.

A request with n choices runs n sequences side by side, and its completion_tokens are
the sum over them. Its time per output token is the time per token of one choice:
(E2E - TTFT) / (completion_tokens / num_choices - 1). Without the count, an n = 4
request would read four times faster than it ran and meet TPOT SLOs it missed. Rows
written before this revision asked for one choice: the only kind served then.

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


def upgrade() -> None:
    op.add_column(
        "usage_records",
        sa.Column("num_choices", sa.SmallInteger(), nullable=False, server_default="1"),
    )


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN, as in 0006 (SQLite 3.35+ has it).
    op.drop_column("usage_records", "num_choices")
