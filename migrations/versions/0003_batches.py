"""Batch API: files (with their bytes), batches (lifecycle and lease) and batch lines.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _time(name: str, *, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        _time("created_at", nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_files_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_files_tenant_id", "files", ["tenant_id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("errors_json", sa.Text(), nullable=True),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        _time("created_at", nullable=False),
        _time("expires_at", nullable=False),
        _time("in_progress_at"),
        _time("finalizing_at"),
        _time("completed_at"),
        _time("failed_at"),
        _time("expired_at"),
        _time("cancelling_at"),
        _time("cancelled_at"),
        sa.Column("owner", sa.String(64), nullable=True),
        _time("lease_expires_at"),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_batches_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_batches_tenant_id_created_at", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), nullable=False),
        sa.Column("line_index", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result_json", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        _time("finished_at"),
        sa.PrimaryKeyConstraint("batch_id", "line_index", name="pk_batch_lines"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_batch_id_custom_id"),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name="fk_batch_lines_batch_id_batches",
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_batch_lines_batch_id_status", "batch_lines", ["batch_id", "status"])


def downgrade() -> None:
    op.drop_index("ix_batch_lines_batch_id_status", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_id_created_at", table_name="batches")
    op.drop_table("batches")
    op.drop_index("ix_files_tenant_id", table_name="files")
    op.drop_table("files")
