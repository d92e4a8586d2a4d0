"""SQLAlchemy models of the Batch API: uploaded files, batches and their lines.

Everything a batch needs to survive a restart lives here: the input file's bytes, the
batch's lifecycle and lease (which gateway drives it, until when), and one row per input
line holding the line's request and, once it has one, its single result. Output and
error files are written from the line rows when the batch ends, so each `custom_id`
appears exactly once across them.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models import Base, UTCDateTime, utcnow

# Line states. A line leaves "pending" exactly once, by a conditional UPDATE.
# Batch statuses, as OpenAI names them.
VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
ACTIVE_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)

LINE_PENDING = "pending"
LINE_SUCCEEDED = "succeeded"  # its result goes to the output file
LINE_FAILED = "failed"  # its result goes to the error file


class FileRow(Base):
    """An uploaded (purpose `batch`) or generated (`batch_output`) file, bytes included.

    The bytes are in the database so that every gateway replica sees the same files and
    a restart loses none.
    """

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    num_bytes: Mapped[int] = mapped_column(BigInteger)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class BatchRow(Base):
    """One batch: its request, lifecycle timestamps, outcome files and driving lease."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(40), ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    # The tier its lines run at, fixed at creation: batch, or the tenant's if lower.
    tier: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    metadata_json: Mapped[str | None] = mapped_column(Text)
    errors_json: Mapped[str | None] = mapped_column(Text)  # validation errors
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    num_lines: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The lease: the gateway driving the batch and until when. Another may take it over
    # once it has lapsed (the owner died without releasing it).
    owner: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class BatchLineRow(Base):
    """One input line: its request body and, once finished, its one result line."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_batch_id_custom_id"),
        Index("ix_batch_lines_batch_id_status", "batch_id", "status"),
    )

    batch_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line_index: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[str] = mapped_column(Text)  # the request body, as JSON
    status: Mapped[str] = mapped_column(String(16), default=LINE_PENDING)
    result_json: Mapped[str | None] = mapped_column(Text)  # the whole output/error line
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
