"""JSON shapes of file and batch objects, as the OpenAI API spells them."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from gateway.batches.store import LineCounts
from gateway.db.batch_models import BatchRow, FileRow


def _epoch(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_view(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.num_bytes,
        "created_at": _epoch(row.created_at),
        "expires_at": None,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_view(row: BatchRow, counts: LineCounts | None, model: str | None) -> dict[str, Any]:
    """`model`: the one this server serves, which runs every batch."""
    counts = counts or LineCounts()
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "model": model,
        "errors": json.loads(row.errors_json) if row.errors_json else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": _epoch(row.created_at),
        "in_progress_at": _epoch(row.in_progress_at),
        "expires_at": _epoch(row.expires_at),
        "finalizing_at": _epoch(row.finalizing_at),
        "completed_at": _epoch(row.completed_at),
        "failed_at": _epoch(row.failed_at),
        "expired_at": _epoch(row.expired_at),
        "cancelling_at": _epoch(row.cancelling_at),
        "cancelled_at": _epoch(row.cancelled_at),
        "request_counts": {
            # total is known once validation has stored the lines
            "total": max(counts.total, row.num_lines),
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "metadata": json.loads(row.metadata_json) if row.metadata_json else None,
        "usage": {
            "input_tokens": counts.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        },
    }
