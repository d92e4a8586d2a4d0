"""Per-request usage records, buffered in memory and written to SQL in batches.

`record()` only appends to a buffer, so the request path never waits on the database;
a background task flushes every `flush_interval_s` (sooner once `max_batch` records are
waiting). If the database is unreachable the records stay buffered and are retried; past
`max_buffered` the oldest are dropped (and counted) rather than growing without bound.

Each batch is one transaction: the records go into usage_records, each with `slo_met`
judged against the SLO its tier had when the request ran (a record made without it, by
its tier's SLO as it stands at the write, read in the same transaction), and their sums
are added to the hourly rollup usage_hourly (an upsert per hour, tenant and tier), so the
rollup never disagrees with the records it sums.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Insert,
    and_,
    case,
    cast,
    delete,
    false,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.models import Tier, UsageHourly, UsageRow
from gateway.observability.slo import (
    INVALID_PREFIX,
    SloTargets,
    billed_tokens,
    is_invalid,
    is_slo_met,
    tpot_ms,
)

log = logging.getLogger(__name__)


_MAX_COST_NANOS = 2**63 - 1  # usage_records.cost_nanos is a 64-bit integer
_MAX_COST_SQL = literal_column(str(_MAX_COST_NANOS))
# Inlined, not bound: PostgreSQL has `bigint >> integer` but no `bigint >> bigint`, the
# type a bound Python int beside a BIGINT column would take.
_HALF_BITS, _LOW_HALF = literal_column("32"), literal_column(str(2**32 - 1))


def saturated_sum_sql(nanos: Any) -> ColumnElement[int]:
    """SUM of a BIGINT column of costs (non-negative), exact up to the column's most and
    that most beyond it, on both databases: SQLite's sum() fails on an overflow, and
    PostgreSQL's is a NUMERIC that usage_hourly cannot hold. The high and low 32 bits
    are summed apart (neither sum can overflow below 2^31 rows) and put together only
    when the total fits."""
    high = cast(func.sum(nanos.op(">>")(_HALF_BITS)), BigInteger)
    low = cast(func.sum(nanos.op("&")(_LOW_HALF)), BigInteger)
    carried = high + low.op(">>")(_HALF_BITS)
    whole = carried * literal_column(str(2**32)) + low.op("&")(_LOW_HALF)
    return func.coalesce(case((carried >= 2**31, _MAX_COST_SQL), else_=whole), 0)


def _saturated_add(stored: Any, added: Any) -> ColumnElement[int]:
    """stored + added for non-negative BIGINT costs, the column's most where it would
    overflow (PostgreSQL fails, SQLite turns the sum into a REAL)."""
    return case((stored > _MAX_COST_SQL - added, _MAX_COST_SQL), else_=stored + added)


@dataclass(frozen=True)
class TokenPrices:
    """A tier's prices per million input and output tokens."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """The price of that many tokens, in the currency of the prices."""
        return self.cost_nanos(input_tokens, output_tokens) / 1e9

    def cost_nanos(self, input_tokens: int, output_tokens: int) -> int:
        """cost() in billionths of the currency, rounded: what usage_records.cost_nanos
        holds. Integers sum exactly in any order (the rollup and the records it sums
        must agree to the unit), and a price per million tokens with up to three
        decimals is exact per token."""
        price_in, price_out = self.input_per_mtok * 1000, self.output_per_mtok * 1000
        # Half away from zero, as SQL's round() prices rows in migration 0008 and
        # rebuild_usage_rollup (Python's round() goes to even).
        nanos = math.floor(input_tokens * price_in + output_tokens * price_out + 0.5)
        # Beyond the column (a price set before the admin API capped prices), the record
        # would fail its batch on every retry: it is billed at the column's most.
        return min(nanos, _MAX_COST_NANOS)


@dataclass(frozen=True)
class UsageRecord:
    """One request's outcome and cost drivers.

    outcome is "ok", "error", "aborted" (client went away), "rejected:<code>" (refused
    at admission, e.g. "rejected:rate_limit_exceeded") or "invalid:<code>" (the client's
    own mistake, errors.unserved_outcome). created_at is aware UTC.
    """

    request_id: str
    tenant_id: str
    tier: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    queue_wait_ms: float | None
    ttft_ms: float | None
    e2e_ms: float
    outcome: str
    created_at: datetime
    # The choices (`n`) the request asked for; completion_tokens is the sum over them.
    num_choices: int = 1
    # The output tokens of its longest choice when it had several (None: one choice,
    # completion_tokens). Its TPOT is that choice's: the choices decode side by side.
    longest_choice_tokens: int | None = None
    # Its tier's SLO when it ran, which it is judged by wherever it is counted (the
    # usage report, /metrics): records are written up to seconds later (longer while the
    # database is away), and an SLO changed meanwhile must not rewrite the verdict. Not
    # a column. None: judged by the tier's SLO at the write.
    slo: SloTargets | None = None
    # Its tier's prices when it ran, which price it (column `cost_nanos`) for the same
    # reason: a price changed after, or a tier deleted, must not re-price it. Not a
    # column. None: priced at the tier's prices at the write.
    prices: TokenPrices | None = None
    # The queue's jobs it bills (a live request's), settled in the queue once the record
    # is written (UsageWriter's on_written): no other gateway bills them again. Not a
    # column.
    job_ids: tuple[str, ...] = ()

    @property
    def decode_tokens(self) -> int:
        """The output tokens TPOT divides by (see gateway.observability.slo.tpot_ms)."""
        if self.longest_choice_tokens is None:
            return self.completion_tokens
        return self.longest_choice_tokens


_MAX_INT = 2**31 - 1
_RECORD_FIELDS = tuple(
    f.name for f in fields(UsageRecord) if f.name not in ("slo", "prices", "job_ids")
)
# What the usage_records columns hold: text lengths, and counts as 32-bit ints.
_TEXT_LIMITS = {"request_id": 64, "tenant_id": 40, "tier": 32, "model": 200, "outcome": 64}
_COUNT_FIELDS = ("prompt_tokens", "completion_tokens")
ROLLUP_COUNTS = (
    "requests",
    "refusals",
    "aborted",
    "input_tokens",
    "output_tokens",
    "slo_met",
    "cost_nanos",
)


def _fit_columns(rec: UsageRecord) -> UsageRecord:
    """The record trimmed to what the columns hold, so that one odd record (an overlong
    model name) cannot make its batch fail forever and block every later one."""
    if not isinstance(rec, UsageRecord):
        raise TypeError(f"expected a UsageRecord, got {type(rec).__name__}")
    if rec.created_at.tzinfo is None:  # would fail its whole batch on every retry
        raise ValueError("UsageRecord.created_at must be timezone-aware")
    if _fits(rec):
        return rec  # the usual record: no copy on the request path
    return replace(
        rec,
        **{name: getattr(rec, name)[:limit] for name, limit in _TEXT_LIMITS.items()},
        **{name: min(max(int(getattr(rec, name)), 0), _MAX_INT) for name in _COUNT_FIELDS},
    )


def _fits(rec: UsageRecord) -> bool:
    for name, limit in _TEXT_LIMITS.items():
        if len(getattr(rec, name)) > limit:
            return False
    for name in _COUNT_FIELDS:
        value = getattr(rec, name)
        if type(value) is not int or not 0 <= value <= _MAX_INT:
            return False
    return True


def is_record_slo_met(rec: UsageRecord, targets: SloTargets | None) -> bool:
    """Whether one record met `targets` (None: its tier is unknown, so nothing is checked).

    The dashboard's definition (gateway.observability.slo); migration 0005 evaluated the
    rows written before it with the same rule in SQL.
    """
    tpot = tpot_ms(rec.e2e_ms, rec.ttft_ms, rec.decode_tokens)
    return is_slo_met(
        targets or SloTargets(), is_ok=rec.outcome == "ok", ttft_ms=rec.ttft_ms, tpot_ms=tpot
    )


def hour_of(at: datetime) -> datetime:
    """The start of the UTC hour holding `at` (aware)."""
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def hourly_sums(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """usage_records rows (with `slo_met`) summed per (hour, tenant, tier), sorted by that
    key: each key once, as one upsert statement needs, and in one order for every writer,
    so that two replicas upserting the same hours cannot deadlock. A client's own
    mistakes (is_invalid) are not summed: the report is of the service offered."""
    sums: dict[tuple[datetime, str, str], list[int]] = {}
    for row in rows:
        outcome = row["outcome"]
        if is_invalid(outcome):
            continue
        key = (hour_of(row["created_at"]), row["tenant_id"], row["tier"])
        counts = sums.setdefault(key, [0] * len(ROLLUP_COUNTS))
        input_tokens, output_tokens = billed_tokens(
            outcome, row["queue_wait_ms"], row["prompt_tokens"], row["completion_tokens"]
        )
        counts[0] += 1
        counts[1] += outcome.startswith("rejected:")
        counts[2] += outcome == "aborted"
        counts[3] += input_tokens
        counts[4] += output_tokens
        counts[5] += bool(row["slo_met"])
        counts[6] = min(counts[6] + row["cost_nanos"], _MAX_COST_NANOS)
    return [
        {
            "hour": hour,
            "tenant_id": tenant_id,
            "tier": tier,
            **dict(zip(ROLLUP_COUNTS, counts, strict=True)),
        }
        for (hour, tenant_id, tier), counts in sorted(sums.items())
    ]


def _rollup_upsert(dialect: str) -> Insert:
    """INSERT INTO usage_hourly ... ON CONFLICT (hour, tenant_id, tier) DO UPDATE adding
    the new counts to the stored ones (atomic per row on both databases)."""
    dialects = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
    if dialect not in dialects:
        raise NotImplementedError(f"usage rollup upsert on {dialect}")
    table = UsageHourly.__table__
    statement = dialects[dialect](table)
    return statement.on_conflict_do_update(
        index_elements=[table.c.hour, table.c.tenant_id, table.c.tier],
        set_={
            name: (_saturated_add if name == "cost_nanos" else operator.add)(
                table.c[name], statement.excluded[name]
            )
            for name in ROLLUP_COUNTS
        },
    )


async def write_usage(session: AsyncSession, records: list[UsageRecord]) -> None:
    """Insert `records` and add them to the hourly rollup, inside the caller's transaction."""
    if not records:
        return
    targets: dict[str, SloTargets] = {}
    prices: dict[str, TokenPrices] = {}
    if tiers := {rec.tier for rec in records if rec.slo is None or rec.prices is None}:
        t = Tier
        found = await session.execute(
            select(
                t.name,
                t.ttft_slo_ms,
                t.tpot_slo_ms,
                t.price_input_per_mtok,
                t.price_output_per_mtok,
            ).where(t.name.in_(tiers))
        )
        for name, ttft, tpot, price_in, price_out in found:
            targets[name] = SloTargets(ttft, tpot)
            prices[name] = TokenPrices(price_in or 0.0, price_out or 0.0)
    # Plain dicts into a Core insert: asdict's deep copies and the ORM's bulk-insert
    # machinery cost more than the database's own work for these flat rows.
    rows = []
    for rec in records:
        row = {name: getattr(rec, name) for name in _RECORD_FIELDS}
        row["slo_met"] = is_record_slo_met(rec, rec.slo or targets.get(rec.tier))
        billed = billed_tokens(
            rec.outcome, rec.queue_wait_ms, rec.prompt_tokens, rec.completion_tokens
        )
        row["cost_nanos"] = (rec.prices or prices.get(rec.tier) or TokenPrices()).cost_nanos(
            *billed
        )
        rows.append(row)
    await session.execute(insert(UsageRow.__table__), rows)
    if sums := hourly_sums(rows):
        await session.execute(_rollup_upsert(session.bind.dialect.name), sums)


async def write_usage_with(session: AsyncSession, record: UsageRecord) -> None:
    """Write one record inside the caller's transaction, with what it pays for (a batch
    line's result): both are kept or both lost, so a crash between the two can neither
    lose a finished line's bill nor bill a line that will run again."""
    await write_usage(session, [_fit_columns(record)])


def summed_sql(columns: Any) -> ColumnElement[bool]:
    """The usage_records the report sums (hourly_sums): all but the client's mistakes."""
    return ~columns.outcome.like(f"{INVALID_PREFIX}%")


def prompt_served_sql(columns: Any) -> ColumnElement[bool]:
    """is_prompt_served in SQL over usage_records' `columns`."""
    return and_(~columns.outcome.like("rejected:%"), columns.queue_wait_ms.is_not(None))


def billed_tokens_sql(columns: Any) -> tuple[ColumnElement[int], ColumnElement[int]]:
    """billed_tokens in SQL over usage_records' `columns`: (input, output) of each row."""
    served_in = case((prompt_served_sql(columns), columns.prompt_tokens), else_=0)
    served_out = case((~columns.outcome.like("rejected:%"), columns.completion_tokens), else_=0)
    return served_in, served_out


def _slo_met_sql() -> ColumnElement[bool]:
    """is_record_slo_met in SQL against the tiers as they are now (migration 0005 holds
    its own copy: a migration never changes with the code)."""
    u, t = UsageRow.__table__.c, Tier.__table__.c

    def tier_slo(column: Any) -> Any:
        return select(column).where(t.name == u.tier).scalar_subquery()

    ttft_slo, tpot_slo = tier_slo(t.ttft_slo_ms), tier_slo(t.tpot_slo_ms)
    decode_ms = case((u.e2e_ms - u.ttft_ms < 0, 0.0), else_=u.e2e_ms - u.ttft_ms)
    tokens = func.coalesce(u.longest_choice_tokens, u.completion_tokens)  # decode_tokens
    # NULLIF: SQL does not promise to stop at `tokens < 2` before dividing.
    tpot = decode_ms / func.nullif(tokens - 1, 0)
    few_tokens = tokens < 2
    met = and_(
        u.outcome == "ok",
        or_(ttft_slo.is_(None), and_(u.ttft_ms.is_not(None), u.ttft_ms <= ttft_slo)),
        or_(tpot_slo.is_(None), u.ttft_ms.is_(None), few_tokens, tpot <= tpot_slo),
    )
    return case((met, true()), else_=false())


def _cost_nanos_sql() -> ColumnElement[int]:
    """A record's billed tokens (billed_tokens) at its tier's prices as they are now, 0
    for a tier that no longer exists (migration 0008 holds its own copy)."""
    u, t = UsageRow.__table__.c, Tier.__table__.c

    def price(column: Any) -> Any:
        return func.coalesce(select(column).where(t.name == u.tier).scalar_subquery(), 0.0)

    served_in, served_out = billed_tokens_sql(u)
    price_in, price_out = price(t.price_input_per_mtok), price(t.price_output_per_mtok)
    nanos = func.round(served_in * price_in * 1000 + served_out * price_out * 1000)
    # At the column's most beyond it, as TokenPrices.cost_nanos (a price set before the
    # admin API capped prices).
    return case((nanos >= float(2**63), _MAX_COST_SQL), else_=cast(nanos, BigInteger))


def _hour_sql(dialect: str, at: Any) -> ColumnElement:
    if dialect == "sqlite":  # the text UTCDateTime writes, truncated to the hour
        return func.strftime("%Y-%m-%d %H:00:00.000000", at)
    return func.timezone("UTC", func.date_trunc("hour", func.timezone("UTC", at)))


async def rebuild_usage_rollup(session: AsyncSession, start: datetime, end: datetime) -> int:
    """Recompute usage_hourly for the UTC hours overlapping [start, end) from usage_records.

    The repair after a rolling upgrade to migration 0005: a gateway still on the previous
    release writes records without `slo_met` and without adding them to the rollup. Those
    records are evaluated against the tiers as they are now (and, written before 0008,
    priced at their current prices), then the hours are summed again. Runs in the
    caller's transaction; on PostgreSQL it locks usage_hourly against writes (reports
    still read) until commit, so a batch written meanwhile waits and then adds to the
    rebuilt rows. Returns the number of rollup rows written.
    """
    first = hour_of(start)
    last = hour_of(end)
    if last < end:
        last += timedelta(hours=1)
    dialect = session.bind.dialect.name
    if dialect == "postgresql":
        await session.execute(text("LOCK TABLE usage_hourly IN EXCLUSIVE MODE"))
    u, h = UsageRow.__table__, UsageHourly.__table__
    in_range = and_(u.c.created_at >= first, u.c.created_at < last)
    await session.execute(
        update(u).where(in_range, u.c.slo_met.is_(None)).values(slo_met=_slo_met_sql())
    )
    await session.execute(
        update(u).where(in_range, u.c.cost_nanos.is_(None)).values(cost_nanos=_cost_nanos_sql())
    )
    await session.execute(delete(h).where(h.c.hour >= first, h.c.hour < last))
    refused = u.c.outcome.like("rejected:%")

    def total(value: ColumnElement) -> ColumnElement:
        return func.coalesce(func.sum(value), 0)

    def total_if(condition: ColumnElement) -> ColumnElement:
        return total(case((condition, 1), else_=0))

    hour = _hour_sql(dialect, u.c.created_at).label("hour")
    sums = (
        select(
            hour,
            u.c.tenant_id,
            u.c.tier,
            func.count(),
            total_if(refused),
            total_if(u.c.outcome == "aborted"),
            *(total(billed) for billed in billed_tokens_sql(u.c)),
            total_if(u.c.slo_met),
            saturated_sum_sql(u.c.cost_nanos),
        )
        .where(in_range, summed_sql(u.c))
        .group_by(literal_column("hour"), u.c.tenant_id, u.c.tier)
    )
    names = ["hour", "tenant_id", "tier", *ROLLUP_COUNTS]
    result = await session.execute(insert(h).from_select(names, sums))
    return max(result.rowcount, 0)


class UsageWriter:
    """Buffers UsageRecords and writes them in batches off the request path."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker,
        *,
        flush_interval_s: float = 0.5,
        max_batch: int = 500,
        max_buffered: int = 100_000,
        on_written: Callable[[list[str]], None] | None = None,
        claimed_elsewhere: Callable[[list[str]], Awaitable[set[str]]] | None = None,
    ) -> None:
        """`on_written` is given the job ids of each batch of records once it is
        written (UsageRecord.job_ids); it must not block or raise. Before a batch is
        written, `claimed_elsewhere` says which of its jobs another gateway has billed
        (gateway.usage_recovery): the records of those are left out."""
        self._sessionmaker = sessionmaker
        self.on_written = on_written
        self.claimed_elsewhere = claimed_elsewhere
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._buffer: deque[UsageRecord] = deque(maxlen=max_buffered)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._is_closing = False
        self._num_in_flight = 0
        self._num_failed_flushes = 0  # consecutive; logs the first in full, then a line
        self.num_written = 0
        self.num_dropped = 0
        self.num_billed_elsewhere = 0  # left out: another gateway billed them (_unclaimed)

    def count_written_elsewhere(self, num_records: int = 1) -> None:
        """Count records written in another transaction (a Batch API line's, with its
        result: write_usage_with) with this writer's, so the written-records metric
        covers every record this gateway stored."""
        self.num_written += num_records

    @property
    def num_pending(self) -> int:
        """Records not yet written (buffered or being written)."""
        return len(self._buffer) + self._num_in_flight

    def record(self, rec: UsageRecord) -> None:
        """Queue one record. Never blocks and never raises."""
        try:
            rec = _fit_columns(rec)
            if len(self._buffer) == self._buffer.maxlen:
                self.num_dropped += 1  # the deque drops the oldest
            self._buffer.append(rec)
            if len(self._buffer) >= self._max_batch:
                self._wake.set()
        except Exception:  # accounting must never fail a request
            log.exception("usage record dropped")

    async def start(self) -> None:
        """Start the background flusher (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tiergate-usage-writer")

    async def aclose(self, *, timeout_s: float = 10.0) -> None:
        """Stop the flusher and write everything still buffered.

        The flusher is asked to stop rather than cancelled, so a batch being written is
        never cut off half way (and lost, or written twice).
        """
        task, self._task = self._task, None
        if task is not None:
            self._is_closing = True
            self._wake.set()
            try:
                await asyncio.wait_for(task, timeout_s)
            except TimeoutError:
                log.error("usage writer did not stop within %.1f s", timeout_s)
        while self._buffer:
            if not await self.flush():
                log.error("usage writer closed with %d records unwritten", len(self._buffer))
                break

    async def flush(self) -> bool:
        """Write up to one batch now; False if the database refused it (kept for retry)."""
        async with self._flush_lock:
            batch = [self._buffer.popleft() for _ in range(min(self._max_batch, len(self._buffer)))]
            if not batch:
                return True
            self._num_in_flight = len(batch)
            try:
                return await self._flush(batch)
            finally:
                self._num_in_flight = 0

    async def _flush(self, batch: list[UsageRecord]) -> bool:
        try:
            kept = await self._unclaimed(batch)
        except Exception as exc:  # the claim check failed: ask again with the next try
            self._requeue(batch, exc)
            return False
        rest: list[UsageRecord] = []  # unwritten, for the next try
        num_refused = 0  # dropped: the database cannot store them
        try:
            await self._write(kept)
        except Exception as exc:
            rest = kept
            if await self._database_answers():
                # The database answers yet refused the batch: retried whole, a record
                # it cannot store would fail the batch forever and hold up every record
                # behind it. Each goes alone, and only such a record is dropped.
                rest, num_refused = await self._write_each(kept)
                self.num_dropped += num_refused
            if rest:
                self._requeue(rest, exc)
        if not rest:
            self._num_failed_flushes = 0
        self.num_written += len(kept) - len(rest) - num_refused
        if num_left_out := len(batch) - len(kept):
            self.num_billed_elsewhere += num_left_out
            log.warning(
                "%d usage records left out: another gateway billed them while this "
                "one did not answer",
                num_left_out,
            )
        pending = {id(rec) for rec in rest}
        settled = [j for rec in batch if id(rec) not in pending for j in rec.job_ids]
        if settled and self.on_written is not None:
            self.on_written(settled)
        return not rest

    async def _write(self, records: list[UsageRecord]) -> None:
        async with self._sessionmaker() as session, session.begin():
            await write_usage(session, records)

    async def _write_each(self, records: list[UsageRecord]) -> tuple[list[UsageRecord], int]:
        """Write each record in a transaction of its own; the records left unwritten, and
        how many were dropped.

        A record the database refuses alone, while it takes others, is one it cannot
        store: it is dropped (counted, logged). When it takes none (no table yet, a
        column a newer release writes) or stops answering, the records are kept.
        """
        refused: list[UsageRecord] = []
        for i, rec in enumerate(records):
            try:
                await self._write([rec])
            except Exception:
                if not await self._database_answers():
                    return refused + records[i:], 0
                refused.append(rec)
        if len(refused) == len(records):
            return refused, 0
        num_dropped = 0
        for j, rec in enumerate(refused):
            try:
                await self._write([rec])  # a second try, in case it met a deadlock
            except Exception:
                if not await self._database_answers():
                    return refused[j:], num_dropped
                num_dropped += 1
                log.exception(
                    "usage record of request %s cannot be stored; dropped", rec.request_id
                )
        return [], num_dropped

    async def _database_answers(self) -> bool:
        try:
            async with self._sessionmaker() as session:
                await session.execute(text("SELECT 1"))
        except Exception:
            return False
        return True

    def _requeue(self, records: list[UsageRecord], exc: Exception) -> None:
        """Put unwritten records back at the front, in order; the oldest fall off if the
        buffer is full."""
        self._num_failed_flushes += 1
        if self._num_failed_flushes == 1:
            log.error("writing %d usage records failed; will retry", len(records), exc_info=exc)
        else:
            log.warning("usage records still unwritten (%s)", type(exc).__name__)
        space = (self._buffer.maxlen or 0) - len(self._buffer)
        num_lost = max(0, len(records) - space)
        self.num_dropped += num_lost
        self._buffer.extendleft(reversed(records[num_lost:]))

    async def _unclaimed(self, batch: list[UsageRecord]) -> list[UsageRecord]:
        """The batch less the records another gateway has billed already."""
        job_ids = [job_id for rec in batch for job_id in rec.job_ids]
        if not job_ids or self.claimed_elsewhere is None:
            return batch
        claimed = await self.claimed_elsewhere(job_ids)
        if not claimed:
            return batch
        return [rec for rec in batch if claimed.isdisjoint(rec.job_ids)]

    async def _run(self) -> None:
        while not self._is_closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_interval_s)
            self._wake.clear()
            while self._buffer and not self._is_closing:
                if not await self.flush():
                    break  # wait an interval before retrying a failing database
                if len(self._buffer) < self._max_batch:
                    break
