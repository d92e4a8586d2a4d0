"""Async SQLAlchemy engine and session factory from a database URL."""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine


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
        cursor.execute("PRAGMA busy_timeout=5000")
        if is_file:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    return engine


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    """Sessions that keep loaded attributes after commit (objects are read after it)."""
    return async_sessionmaker(engine, expire_on_commit=False)
