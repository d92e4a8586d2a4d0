"""`tiergate usage rebuild-rollup` repairs the hourly rollup from the raw usage records."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, func, select, update

from gateway.cli import main
from gateway.db.models import UsageHourly, UsageRow
from gateway.usage import UsageRecord, UsageWriter

HOUR = datetime(2025, 6, 1, 10, 0, tzinfo=UTC)


def _record(i: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"req_{i}",
        tenant_id="ten_cli",
        tier="interactive",
        model="tiny-random",
        prompt_tokens=10,
        completion_tokens=5,
        queue_wait_ms=1.0,
        ttft_ms=20.0,
        e2e_ms=50.0,
        outcome="ok",
        created_at=HOUR + timedelta(minutes=i),
    )


async def _rollup(sessionmaker) -> list[tuple[int, int]]:
    async with sessionmaker() as session:
        rows = await session.execute(
            select(UsageHourly.requests, UsageHourly.output_tokens).order_by(UsageHourly.hour)
        )
        return [tuple(row) for row in rows]


async def test_rebuild_rollup_restores_hours_a_legacy_writer_left_out(
    db_sessionmaker, migrated_database_url: str, capsys
) -> None:
    writer = UsageWriter(db_sessionmaker, flush_interval_s=0.01)
    await writer.start()
    for i in range(90):  # two hours: 10:00-10:59 and 11:00-11:29
        writer.record(_record(i))
    await writer.aclose()
    expected = await _rollup(db_sessionmaker)
    assert expected == [(60, 300), (30, 150)]

    # What a gateway of the release before the rollup leaves behind.
    async with db_sessionmaker() as session, session.begin():
        await session.execute(update(UsageRow).values(slo_met=None))
        await session.execute(delete(UsageHourly))
    assert await _rollup(db_sessionmaker) == []

    argv = ["usage", "rebuild-rollup", "--database-url", migrated_database_url,
            "--start", "2025-06-01T00:00:00", "--end", "2025-06-02T00:00:00"]  # fmt: skip
    assert await asyncio.to_thread(main, argv) == 0
    assert "2 hourly rows written" in capsys.readouterr().out
    assert await _rollup(db_sessionmaker) == expected
    async with db_sessionmaker() as session:
        missing = await session.scalar(
            select(func.count()).select_from(UsageRow).where(UsageRow.slo_met.is_(None))
        )
    assert missing == 0


def test_rebuild_rollup_rejects_an_empty_range(capsys) -> None:
    argv = ["usage", "rebuild-rollup", "--start", "2025-06-02", "--end", "2025-06-01"]
    assert main(argv) == 2
    assert "--end must be after --start" in capsys.readouterr().err


def test_simulate_is_a_tiergate_command(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--help"])
    assert exited.value.code == 0
    assert "simulate" in capsys.readouterr().out


def test_usage_alone_prints_its_own_help(capsys) -> None:
    assert main(["usage"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tiergate usage")
    assert "rebuild-rollup" in err
