"""SQL operations of the Batch API: files, batches, lines and the driving lease.

Every state change that must happen once is a conditional UPDATE whose row count says
whether this caller made it: a line leaves `pending` once (so it has one result line),
a lease is taken only when free or lapsed, and a batch ends in one transaction that
writes its output and error files together with its final status.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, case, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import aliased, defer

from gateway.batches.validation import InputLine, LineError
from gateway.db.batch_models import (
    ACTIVE_STATUSES,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    LINE_FAILED,
    LINE_PENDING,
    LINE_SUCCEEDED,
    VALIDATING,
    BatchLineRow,
    BatchRow,
    FileRow,
)
from gateway.db.models import Tenant, utcnow
from gateway.openai.schemas import MAX_CHOICES
from gateway.usage import UsageRecord, write_usage_with

OUTPUT_PURPOSE = "batch_output"  # the files batches write

# The timestamp column each status sets when a batch enters it.
_STATUS_TIME = {
    IN_PROGRESS: "in_progress_at",
    FINALIZING: "finalizing_at",
    COMPLETED: "completed_at",
    FAILED: "failed_at",
    EXPIRED: "expired_at",
    CANCELLING: "cancelling_at",
    CANCELLED: "cancelled_at",
}
INSERT_CHUNK_LINES = 1_000


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)
_FILE_ID = re.compile(r"file-([0-9a-f]{12})[0-9a-f]{12}")


def _whole_ms(at: datetime) -> datetime:
    """A file's creation time: `at` to the millisecond its id holds."""
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def new_file_id(created_at: datetime) -> str:
    """`file-`, the creation time in milliseconds (12 hex digits) and 48 random bits.
    The id alone places the file in the (created_at, id) order of a listing, so a client
    listing with `after=` a file it has just deleted (delete-while-listing, as the
    client's auto-pagination does) gets the next page instead of a 400."""
    return f"file-{(created_at - _EPOCH) // _MS:012x}{secrets.token_hex(6)}"


def _file_id_created_at(file_id: str) -> datetime | None:
    """The creation time a file id holds (None: not one of new_file_id's form)."""
    match = _FILE_ID.fullmatch(file_id)
    return None if match is None else _EPOCH + int(match.group(1), 16) * _MS


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


# str.splitlines, and so many JSONL readers, also end a line at these. JSON allows them
# raw in strings, where a prompt or the model's text may put them: escaped, every record
# is one line for any reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def result_line(
    custom_id: str,
    *,
    response: dict | None = None,
    error: dict | None = None,
) -> str:
    """One line of an output or error file, as JSON."""
    line = {
        "id": f"batch_req_{secrets.token_hex(12)}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)


@dataclass(frozen=True)
class LineCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class PendingLine:
    line_index: int
    custom_id: str
    body_json: str

    @functools.cached_property
    def num_choices(self) -> int:
        """The jobs the line asks for: its body's `n` for each of its prompts (checked
        when it runs; 1 where the body holds no usable count). Read once: a body may be
        megabytes of JSON."""
        try:
            body = json.loads(self.body_json)
            n, prompt = body.get("n"), body.get("prompt")
        except (ValueError, AttributeError):
            return 1
        n = n if type(n) is int and 1 <= n <= MAX_CHOICES else 1
        # A list of prompts (strings or token-id lists), not one prompt of token ids.
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            n *= len(prompt)
        return min(n, MAX_CHOICES)


class StorageQuotaError(Exception):
    """An upload would take a tenant's files past their quota."""

    def __init__(self, used_bytes: int, quota_bytes: int) -> None:
        super().__init__(f"{used_bytes} of {quota_bytes} bytes in use")
        self.used_bytes = used_bytes
        self.quota_bytes = quota_bytes


class BatchStore:
    """The Batch API's tables, one short transaction per call."""

    def __init__(self, sessionmaker: async_sessionmaker) -> None:
        self._sessionmaker = sessionmaker

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """The tenant a batch belongs to, or None once it was deleted."""
        async with self._sessionmaker() as session:
            return await session.get(Tenant, tenant_id)

    # Files ---------------------------------------------------------------------------

    async def create_file(
        self,
        tenant_id: str,
        *,
        purpose: str,
        filename: str,
        content: bytes,
        quota_bytes: int | None = None,
    ) -> FileRow:
        """Store an upload; StorageQuotaError if the tenant's uploads would then hold
        more than `quota_bytes` (the files batches write are not counted: they are
        bounded by their inputs)."""
        created_at = _whole_ms(utcnow())
        row = FileRow(
            id=new_file_id(created_at),
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename,
            num_bytes=len(content),
            content=content,
            created_at=created_at,
        )
        async with self._sessionmaker() as session, session.begin():
            if quota_bytes is not None:
                # The tenant's row locked (PostgreSQL; SQLite writes one at a time): two
                # uploads at once cannot both fit in the room left for one.
                await session.execute(
                    select(Tenant.id).where(Tenant.id == tenant_id).with_for_update()
                )
                used = await session.scalar(
                    select(func.coalesce(func.sum(FileRow.num_bytes), 0)).where(
                        FileRow.tenant_id == tenant_id, FileRow.purpose != OUTPUT_PURPOSE
                    )
                )
                if used + len(content) > quota_bytes:
                    raise StorageQuotaError(int(used), quota_bytes)
            session.add(row)
        return row

    async def get_file(self, tenant_id: str, file_id: str) -> FileRow | None:
        """The file's metadata (its bytes are not loaded)."""
        async with self._sessionmaker() as session:
            return await session.scalar(
                select(FileRow)
                .options(defer(FileRow.content, raiseload=True))
                .where(FileRow.id == file_id, FileRow.tenant_id == tenant_id)
            )

    async def list_files(
        self,
        tenant_id: str,
        *,
        limit: int,
        after: str | None,
        descending: bool,
        purpose: str | None,
    ) -> tuple[list[FileRow], bool] | None:
        """A page of the tenant's files (bytes not loaded) and whether more follow,
        after the place of the file `after` (its own, or one deleted since: its id holds
        that place); None if `after` is no file id."""
        async with self._sessionmaker() as session:
            query = (
                select(FileRow)
                .options(defer(FileRow.content, raiseload=True))
                .where(FileRow.tenant_id == tenant_id)
            )
            if purpose is not None:
                query = query.where(FileRow.purpose == purpose)
            if after is not None:
                cursor = await session.scalar(
                    select(FileRow.created_at).where(
                        FileRow.id == after, FileRow.tenant_id == tenant_id
                    )
                )
                # Files stored before ids held their time have random ids: one of those
                # deleted (or another tenant's) is no place.
                cursor = cursor or _file_id_created_at(after)
                if cursor is None:
                    return None
                query = query.where(_past_cursor(FileRow, cursor, after, descending))
            rows = list((await session.scalars(_in_order(query, FileRow, descending, limit))).all())
        return rows[:limit], len(rows) > limit

    async def get_file_content(self, tenant_id: str, file_id: str) -> bytes | None:
        async with self._sessionmaker() as session:
            return await session.scalar(
                select(FileRow.content).where(FileRow.id == file_id, FileRow.tenant_id == tenant_id)
            )

    async def delete_file(self, tenant_id: str, file_id: str) -> bool:
        async with self._sessionmaker() as session, session.begin():
            result = await session.execute(
                delete(FileRow).where(FileRow.id == file_id, FileRow.tenant_id == tenant_id)
            )
            return result.rowcount > 0

    # Batches -------------------------------------------------------------------------

    async def create_batch(
        self,
        tenant_id: str,
        *,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        window_s: int,
        tier: str,
        metadata: dict[str, str] | None,
    ) -> BatchRow:
        now = utcnow()
        row = BatchRow(
            id=new_batch_id(),
            tenant_id=tenant_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            tier=tier,
            status=VALIDATING,
            metadata_json=json.dumps(metadata) if metadata is not None else None,
            num_lines=0,
            created_at=now,
            expires_at=now + timedelta(seconds=window_s),
        )
        async with self._sessionmaker() as session, session.begin():
            session.add(row)
        return row

    async def get_batch(self, batch_id: str, tenant_id: str | None = None) -> BatchRow | None:
        """The batch, if it exists and (when tenant_id is given) belongs to that tenant."""
        async with self._sessionmaker() as session:
            query = select(BatchRow).where(BatchRow.id == batch_id)
            if tenant_id is not None:
                query = query.where(BatchRow.tenant_id == tenant_id)
            return await session.scalar(query)

    async def list_batches(
        self, tenant_id: str, *, limit: int, after: str | None
    ) -> tuple[list[BatchRow], bool] | None:
        """A page of the tenant's batches, newest first, and whether more follow; None if
        `after` names no batch of the tenant."""
        async with self._sessionmaker() as session:
            query = select(BatchRow).where(BatchRow.tenant_id == tenant_id)
            if after is not None:
                cursor = await session.get(BatchRow, after)
                if cursor is None or cursor.tenant_id != tenant_id:
                    return None
                query = query.where(_past_cursor(BatchRow, cursor.created_at, cursor.id, True))
            rows = list((await session.scalars(_in_order(query, BatchRow, True, limit))).all())
        return rows[:limit], len(rows) > limit

    async def line_counts(self, batch_ids: Sequence[str]) -> dict[str, LineCounts]:
        """request_counts and token usage of each batch, from its lines."""
        if not batch_ids:
            return {}
        async with self._sessionmaker() as session:
            rows = await session.execute(
                select(
                    BatchLineRow.batch_id,
                    BatchLineRow.status,
                    func.count(),
                    func.coalesce(func.sum(BatchLineRow.prompt_tokens), 0),
                    func.coalesce(func.sum(BatchLineRow.completion_tokens), 0),
                )
                .where(BatchLineRow.batch_id.in_(list(batch_ids)))
                .group_by(BatchLineRow.batch_id, BatchLineRow.status)
            )
            totals: dict[str, dict[str, int]] = {}
            for batch_id, status, count, prompt, completion in rows:
                t = totals.setdefault(batch_id, dict.fromkeys(("t", "c", "f", "p", "o"), 0))
                t["t"] += count
                t["c"] += count if status == LINE_SUCCEEDED else 0
                t["f"] += count if status == LINE_FAILED else 0
                t["p"] += int(prompt)
                t["o"] += int(completion)
        return {
            batch_id: LineCounts(t["t"], t["c"], t["f"], t["p"], t["o"])
            for batch_id, t in totals.items()
        }

    async def request_cancel(self, batch_id: str) -> bool:
        """Move an active batch to `cancelling`; False if it is no longer active."""
        async with self._sessionmaker() as session, session.begin():
            result = await session.execute(
                update(BatchRow)
                .where(
                    BatchRow.id == batch_id,
                    BatchRow.status.in_((VALIDATING, IN_PROGRESS)),
                )
                .values(status=CANCELLING, cancelling_at=utcnow())
            )
            return result.rowcount > 0

    # The lease -----------------------------------------------------------------------

    async def claim(
        self, owner: str, lease_s: float, *, limit: int, per_tenant: int | None = None
    ) -> list[str]:
        """Take the lease of up to `limit` active batches that have no live owner.

        The claim goes round the tenants, those with the fewest batches driven
        (anywhere in the fleet) first, each tenant's oldest batch first; a tenant
        driving `per_tenant` batches waits, so one tenant's backlog of batches slows
        the others instead of holding every slot.
        A suspended tenant's batches are left alone (they would only hold a slot) until
        it is active again or they are past their window, when they are claimed to end.
        A batch that only has to be ended (cancelled, or past its window) is claimed
        first and outside the tenant's cap: ending it takes a moment, and a cancel must
        not wait for the tenant's running batches to finish.
        """
        now = utcnow()
        free = or_(BatchRow.owner.is_(None), BatchRow.lease_expires_at < now)
        driven = aliased(BatchRow)
        num_driven = (
            select(func.count())
            .where(
                driven.tenant_id == BatchRow.tenant_id,
                driven.status.in_(ACTIVE_STATUSES),
                driven.owner.is_not(None),
                driven.lease_expires_at >= now,
            )
            .correlate(BatchRow)
            .scalar_subquery()
        )
        runnable = or_(Tenant.status == "active", BatchRow.expires_at < now)
        # A free batch's place: which of its tenant's driven batches it would be (those
        # driven now, then its rank among the tenant's free ones, oldest first). Taking
        # the lowest places first goes round the tenants, fewest driven first.
        rank = func.row_number().over(partition_by=BatchRow.tenant_id, order_by=BatchRow.created_at)
        to_end = case((or_(BatchRow.status == CANCELLING, BatchRow.expires_at < now), 0), else_=1)
        free_batches = (
            select(
                BatchRow.id,
                BatchRow.created_at,
                (num_driven + rank).label("place"),
                to_end.label("runs"),
            )
            .join(Tenant, Tenant.id == BatchRow.tenant_id)
            .where(BatchRow.status.in_(ACTIVE_STATUSES), free, runnable)
            .subquery()
        )
        query = (
            select(free_batches.c.id)
            .order_by(free_batches.c.runs, free_batches.c.place, free_batches.c.created_at)
            .limit(limit)
        )
        if per_tenant is not None:
            # Soft: two drivers claiming at once may both take a tenant's last place.
            query = query.where(or_(free_batches.c.place <= per_tenant, free_batches.c.runs == 0))
        async with self._sessionmaker() as session:
            candidates = list((await session.scalars(query)).all())
        claimed = []
        for batch_id in candidates:
            async with self._sessionmaker() as session, session.begin():
                result = await session.execute(
                    update(BatchRow)
                    .where(BatchRow.id == batch_id, free)
                    .values(owner=owner, lease_expires_at=now + timedelta(seconds=lease_s))
                )
                if result.rowcount > 0:
                    claimed.append(batch_id)
        return claimed

    async def renew(self, batch_id: str, owner: str, lease_s: float) -> BatchRow | None:
        """Extend this owner's lease; the batch as it is now, or None if the lease is lost."""
        async with self._sessionmaker() as session, session.begin():
            result = await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.owner == owner)
                .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
            )
            if result.rowcount == 0:
                return None
            return await session.get(BatchRow, batch_id)

    async def release(self, batch_id: str, owner: str) -> None:
        """Give the lease up (on shutdown) so another gateway takes over at once."""
        async with self._sessionmaker() as session, session.begin():
            await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.owner == owner)
                .values(owner=None, lease_expires_at=None)
            )

    # Driving a batch (the owner only) ------------------------------------------------

    async def store_validation(
        self, batch_id: str, owner: str, lines: list[InputLine], errors: list[LineError]
    ) -> bool:
        """Insert the lines and start the batch, or fail it with `errors`; one transaction."""
        now = utcnow()
        async with self._sessionmaker() as session, session.begin():
            values: dict = {}
            if errors:
                payload = {"object": "list", "data": [e.as_dict() for e in errors]}
                values = {"status": FAILED, "failed_at": now, "errors_json": json.dumps(payload)}
            else:
                values = {"status": IN_PROGRESS, "in_progress_at": now, "num_lines": len(lines)}
            result = await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.owner == owner)
                .where(BatchRow.status == VALIDATING)
                .values(**values)
            )
            if result.rowcount == 0:
                return False  # cancelled meanwhile, or the lease was lost: roll back
            for start in range(0, len(lines), INSERT_CHUNK_LINES):
                session.add_all(
                    BatchLineRow(
                        batch_id=batch_id,
                        line_index=line.line_index,
                        custom_id=line.custom_id,
                        body=line.body_json,
                        status=LINE_PENDING,
                        prompt_tokens=0,
                        completion_tokens=0,
                    )
                    for line in lines[start : start + INSERT_CHUNK_LINES]
                )
                await session.flush()
            return True

    async def pending_lines(
        self, batch_id: str, *, after_index: int, limit: int
    ) -> list[PendingLine]:
        async with self._sessionmaker() as session:
            rows = await session.execute(
                select(BatchLineRow.line_index, BatchLineRow.custom_id, BatchLineRow.body)
                .where(
                    BatchLineRow.batch_id == batch_id,
                    BatchLineRow.status == LINE_PENDING,
                    BatchLineRow.line_index > after_index,
                )
                .order_by(BatchLineRow.line_index)
                .limit(limit)
            )
            return [PendingLine(*row) for row in rows]

    async def num_pending(self, batch_id: str) -> int:
        async with self._sessionmaker() as session:
            return (
                await session.scalar(
                    select(func.count()).where(
                        BatchLineRow.batch_id == batch_id, BatchLineRow.status == LINE_PENDING
                    )
                )
                or 0
            )

    async def finish_line(
        self,
        batch_id: str,
        line_index: int,
        *,
        is_success: bool,
        result_json: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        usage: UsageRecord | None = None,
    ) -> bool:
        """Store a line's one result, and its usage record in the same transaction;
        False if it already had one (nothing changes, nothing is billed again)."""
        async with self._sessionmaker() as session, session.begin():
            result = await session.execute(
                update(BatchLineRow)
                .where(
                    BatchLineRow.batch_id == batch_id,
                    BatchLineRow.line_index == line_index,
                    BatchLineRow.status == LINE_PENDING,
                )
                .values(
                    status=LINE_SUCCEEDED if is_success else LINE_FAILED,
                    result_json=result_json,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    finished_at=utcnow(),
                )
            )
            if result.rowcount == 0:
                return False
            if usage is not None:
                await write_usage_with(session, usage)
            return True

    async def begin_finalizing(self, batch_id: str, owner: str) -> bool:
        return await self._transition(batch_id, owner, IN_PROGRESS, FINALIZING)

    async def finish_batch(
        self, batch_id: str, owner: str, *, final_status: str, close_code: str | None = None
    ) -> bool:
        """End the batch: close any pending lines with `close_code` (cancel, expiry),
        write the output and error files and set `final_status`, all in one transaction.
        """
        now = utcnow()
        async with self._sessionmaker() as session, session.begin():
            batch = await session.scalar(
                select(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.owner == owner)
                .with_for_update()
            )
            if batch is None or batch.status not in ACTIVE_STATUSES:
                return False
            if close_code is not None:
                await _close_pending(session, batch_id, close_code, now)
            output, errors = await _result_files(session, batch_id)
            batch.output_file_id = await _add_output_file(session, batch, "output", output, now)
            batch.error_file_id = await _add_output_file(session, batch, "error", errors, now)
            batch.status = final_status
            setattr(batch, _STATUS_TIME[final_status], now)
            batch.owner = None
            batch.lease_expires_at = None
            return True

    async def _transition(self, batch_id: str, owner: str, old: str, new: str) -> bool:
        async with self._sessionmaker() as session, session.begin():
            result = await session.execute(
                update(BatchRow)
                .where(BatchRow.id == batch_id, BatchRow.owner == owner, BatchRow.status == old)
                .values(status=new, **{_STATUS_TIME[new]: utcnow()})
            )
            return result.rowcount > 0


def _past_cursor(model: Any, created_at: datetime, row_id: str, descending: bool) -> Any:
    """Rows after the cursor row in (created_at, id) order: a keyset page, stable when
    rows are added meanwhile and when two share a creation time."""
    if descending:
        return or_(
            model.created_at < created_at, and_(model.created_at == created_at, model.id < row_id)
        )
    return or_(
        model.created_at > created_at, and_(model.created_at == created_at, model.id > row_id)
    )


def _in_order(query: Select, model: Any, descending: bool, limit: int) -> Select:
    """`query` in (created_at, id) order, one row past `limit` (it tells has_more)."""
    if descending:
        return query.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)
    return query.order_by(model.created_at, model.id).limit(limit + 1)


_CLOSE_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request finished.",
    "batch_failed": "The batch failed before this request finished.",
    "batch_expired": "This request did not finish before the batch's completion window ended.",
}


async def _close_pending(session: AsyncSession, batch_id: str, code: str, now: datetime) -> None:
    pending = await session.execute(
        select(BatchLineRow.line_index, BatchLineRow.custom_id).where(
            BatchLineRow.batch_id == batch_id, BatchLineRow.status == LINE_PENDING
        )
    )
    message = _CLOSE_MESSAGES.get(code, code)
    for line_index, custom_id in pending.all():
        await session.execute(
            update(BatchLineRow)
            .where(
                BatchLineRow.batch_id == batch_id,
                BatchLineRow.line_index == line_index,
                BatchLineRow.status == LINE_PENDING,
            )
            .values(
                status=LINE_FAILED,
                result_json=result_line(custom_id, error={"code": code, "message": message}),
                finished_at=now,
            )
        )


async def _result_files(session: AsyncSession, batch_id: str) -> tuple[bytes, bytes]:
    rows = await session.execute(
        select(BatchLineRow.status, BatchLineRow.result_json)
        .where(BatchLineRow.batch_id == batch_id, BatchLineRow.status != LINE_PENDING)
        .order_by(BatchLineRow.line_index)
    )
    output: list[str] = []
    errors: list[str] = []
    for status, result_json in rows:
        (output if status == LINE_SUCCEEDED else errors).append(result_json)
    return _jsonl(output), _jsonl(errors)


def _jsonl(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


async def _add_output_file(
    session: AsyncSession, batch: BatchRow, kind: str, content: bytes, now: datetime
) -> str | None:
    if not content:
        return None  # as OpenAI: no output file without successes, no error file without errors
    created_at = _whole_ms(now)
    row = FileRow(
        id=new_file_id(created_at),
        tenant_id=batch.tenant_id,
        purpose=OUTPUT_PURPOSE,
        filename=f"{batch.id}_{kind}.jsonl",
        num_bytes=len(content),
        content=content,
        created_at=created_at,
    )
    session.add(row)
    await session.flush()
    return row.id
