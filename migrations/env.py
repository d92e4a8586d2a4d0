"""Alembic environment: async engines, SQLite and PostgreSQL alike.

`gateway.migrate` hands over an open connection in `config.attributes["connection"]`;
without one (plain `alembic -x` use) the URL in `sqlalchemy.url` is used.
"""

from __future__ import annotations

import asyncio

from alembic import context

from gateway.db.models import Base
from gateway.db.session import create_db_engine

target_metadata = Base.metadata


def _run_migrations(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_own_engine(url: str) -> None:
    engine = create_db_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_run_migrations)
    finally:
        await engine.dispose()


def _main() -> None:
    if context.is_offline_mode():
        raise RuntimeError("offline (SQL script) migrations are not supported")
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run_migrations(connection)
    else:
        asyncio.run(_run_with_own_engine(context.config.get_main_option("sqlalchemy.url")))


_main()
