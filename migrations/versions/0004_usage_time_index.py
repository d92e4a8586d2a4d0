"""Usage aggregation index: usage_records by time, covering what /admin/v1/usage sums.

/admin/v1/usage scans a time range of usage_records across every tenant and tier; the
older indexes lead with tenant_id or tier. On PostgreSQL the index also carries the
summed columns (INCLUDE), so the aggregation is an index-only scan of the range.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

INCLUDED = [
    "tenant_id",
    "tier",
    "outcome",
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "e2e_ms",
]


def upgrade() -> None:
    op.create_index(
        "ix_usage_records_created_at",
        "usage_records",
        ["created_at"],
        postgresql_include=INCLUDED,
    )


def downgrade() -> None:
    op.drop_index("ix_usage_records_created_at", table_name="usage_records")
