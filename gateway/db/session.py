"""Async SQLAlchemy engine and session factory from a database URL."""

from __future__ import annotations

import sqlite3
import time

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

# How long a SQLite connection waits for another's lock before 'database is locked'.
SQLITE_BUSY_TIMEOUT_MS = 5000


def create_db_engine(database_url: str) -> AsyncEngine:
    """An async engine for `sqlite+aiosqlite://...` or `postgresql+asyncpg://...`.

    On SQLite, foreign keys are switched on (they are off by default there, and deleting
    a tier in use must fail on both backends), and a file database uses WAL with a busy
    timeout so the usage writer and admin writes do not fail each other with 'locked'.
    """
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return create_async_engine(url, pool_pre_ping=True)
    engine = create_async_engine(url)
    is_file = url.database not in (None, "", ":memory:")

    @event.listens_for(engine.sync_engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        if is_file:
            _switch_to_wal(cursor)
        cursor.close()

    return engine


def _switch_to_wal(cursor) -> None:
    """Switch a file database to WAL, retrying while another connection holds it.

    A fresh (empty) file is not yet WAL on disk, so every connection switches it, and two
    that race for the exclusive lock the switch needs can deadlock: SQLite then fails one
    at once with 'database is locked' without calling the busy handler (two `tiergate
    migrate` or `serve` started together on a new data dir). Retrying after the other
    finishes succeeds, so retry for as long as the busy timeout would have waited.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    """Sessions that keep loaded attributes after commit (objects are read after it)."""
    return async_sessionmaker(engine, expire_on_commit=False)
