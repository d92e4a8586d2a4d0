"""Run the Alembic migrations in migrations/ against a database URL, without alembic.ini.

The entry points are synchronous, for the CLI. Each runs its own event loop on a private
thread, so it is also safe to call while another loop runs in the calling thread (from
async code prefer `await asyncio.to_thread(upgrade_to_head, url)` so the loop is not
blocked).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from gateway.db.session import create_db_engine


def _script_location() -> str:
    # Found, not imported: nothing imports the migrations package (its env.py runs
    # migrations when loaded).
    spec = importlib.util.find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'migrations' package is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))))


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and `database_url`."""
    config = Config()
    config.set_main_option("script_location", _script_location())
    # '%' is ConfigParser interpolation syntax; a password may contain it.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


T = TypeVar("T")


def _in_own_thread(fn: Callable[[], T]) -> T:
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="tiergate-migrate")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _run(database_url: str, operation: Callable[[Config], None]) -> None:
    config = alembic_config(database_url)

    async def main() -> None:
        engine = create_db_engine(database_url)
        try:
            async with engine.begin() as connection:

                def run(sync_connection) -> None:
                    config.attributes["connection"] = sync_connection
                    operation(config)

                await connection.run_sync(run)
        finally:
            await engine.dispose()

    _in_own_thread(lambda: asyncio.run(main()))


def upgrade_to_head(database_url: str) -> None:
    """Upgrade the database to the newest revision (creating the schema if empty)."""
    _run(database_url, lambda config: command.upgrade(config, "head"))


def downgrade_to(database_url: str, rev: str) -> None:
    """Downgrade to revision `rev` (`"base"` drops everything the migrations created)."""
    _run(database_url, lambda config: command.downgrade(config, rev))


def head_revisions() -> tuple[str, ...]:
    """The head revisions of the migration scripts (a healthy history has exactly one)."""
    return tuple(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())


def current_revision(database_url: str) -> str | None:
    """The revision the database is at, or None for an unmigrated database."""

    async def main() -> str | None:
        engine = create_db_engine(database_url)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(
                    lambda sync_connection: MigrationContext.configure(
                        sync_connection
                    ).get_current_revision()
                )
        finally:
            await engine.dispose()

    return _in_own_thread(lambda: asyncio.run(main()))
