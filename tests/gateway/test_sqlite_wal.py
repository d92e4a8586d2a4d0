"""The embedded SQLite database: connections opened together on a new file all succeed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import text

from gateway.db.session import create_db_engine


async def _open_then_write(url: str) -> None:
    # What `tiergate migrate` and `serve` do on start: one connection to check the
    # database is reachable, then a second that takes the write lock.
    engine = create_db_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
        await engine.dispose()
        async with engine.connect() as connection:
            await connection.exec_driver_sql("BEGIN IMMEDIATE")
            await connection.exec_driver_sql("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
            await connection.exec_driver_sql("COMMIT")
    finally:
        await engine.dispose()


def test_connections_racing_to_switch_a_new_file_to_wal_all_succeed(tmp_path: Path) -> None:
    # A new file is switched to WAL by every connection until the first write lands, and
    # two switching at once deadlock; SQLite fails one at once with 'database is locked'
    # (no busy wait). Before the switch was retried, about one round in thirty failed.
    async def rounds() -> None:
        for round_ in range(120):
            url = f"sqlite+aiosqlite:///{tmp_path / f'{round_}.db'}"
            await asyncio.gather(*(_open_then_write(url) for _ in range(3)))

    asyncio.run(rounds())
