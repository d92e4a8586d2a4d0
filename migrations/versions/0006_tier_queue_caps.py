"""Tier queue caps: tiers.max_queued_jobs, and a cap on the seeded batch tier.

A tier's queue may hold at most `max_queued_jobs` queued jobs (all its tenants together;
NULL = no cap); past it the queue refuses new work with 429 `queue_full`. Tiers with a
TTFT SLO are bounded by admission already (work that cannot start within the SLO is
refused); a throughput tier has no SLO, so without a cap its queue, and the Redis memory
it takes, grow with whatever clients send.

The seeded batch tier gets 10,000: deep enough that online batch-tier requests are
refused only when the fleet is hopelessly behind (a 24 h window holds far more work than
a queue that size), while the queue stays a bounded number of job records. Batch API
lines the cap refuses stay pending and are retried, so a large batch is slowed, never
failed. Only a batch row whose cap is still unset is touched (the column is new, so
every row's is).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SEEDED_BATCH_MAX_QUEUED_JOBS = 10_000

_tiers = sa.table("tiers", sa.column("name", sa.String), sa.column("max_queued_jobs", sa.Integer))


def upgrade() -> None:
    op.add_column("tiers", sa.Column("max_queued_jobs", sa.Integer(), nullable=True))
    op.execute(
        _tiers.update()
        .where(_tiers.c.name == "batch", _tiers.c.max_queued_jobs.is_(None))
        .values(max_queued_jobs=SEEDED_BATCH_MAX_QUEUED_JOBS)
    )


def downgrade() -> None:
    # A plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+ has it), not batch mode: batch mode
    # copies the table and drops the original, which the tenants' foreign key to tiers
    # forbids while any tenant exists.
    op.drop_column("tiers", "max_queued_jobs")
