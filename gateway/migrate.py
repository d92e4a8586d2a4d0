"""Run the Alembic migrations in migrations/ against a database URL, without alembic.ini.

The entry points are synchronous, for the CLI. Each runs its own event loop on a private
thread, so it is also safe to call while another loop runs in the calling thread (from
async code prefer `await asyncio.to_thread(upgrade_to_head, url)` so the loop is not
blocked).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from gateway.db.session import create_db_engine
from gateway.errors import GatewayError
from gateway.settings import redacted_url


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


# Two `tiergate migrate` runs at once (a Job retried while its first pod still runs, two
# operators) would both create the schema of a fresh database and one would fail on a
# duplicate. On PostgreSQL each run holds this transaction-scoped advisory lock (scoped to
# the database), so the second waits and then finds nothing left to do. On SQLite the
# run takes the database's write lock before it reads the revision (BEGIN IMMEDIATE; a
# deferred transaction let both read "no schema" first), waiting up to
# _SQLITE_LOCK_WAIT_MS for another run to finish.
_MIGRATION_LOCK_KEY = int.from_bytes(b"tiergate", "big")
_SQLITE_LOCK_WAIT_MS = 120_000


class SchemaRevisionError(GatewayError):
    """The database's schema revision is one this release cannot run on or migrate."""


def _run(database_url: str, operation: Callable[[Config, Connection], T]) -> T:
    config = alembic_config(database_url)

    async def main() -> T:
        engine = create_db_engine(database_url)
        try:
            async with engine.begin() as connection:

                def run(sync_connection: Connection) -> T:
                    if sync_connection.dialect.name == "postgresql":
                        sync_connection.execute(
                            text("SELECT pg_advisory_xact_lock(:key)"),
                            {"key": _MIGRATION_LOCK_KEY},
                        )
                    elif sync_connection.dialect.name == "sqlite":
                        sync_connection.exec_driver_sql(
                            f"PRAGMA busy_timeout = {_SQLITE_LOCK_WAIT_MS}"
                        )
                        sync_connection.exec_driver_sql("BEGIN IMMEDIATE")
                    config.attributes["connection"] = sync_connection
                    return operation(config, sync_connection)

                return await connection.run_sync(run)
        finally:
            await engine.dispose()

    return _in_own_thread(lambda: asyncio.run(main()))


def _current(connection: Connection, database_url: str) -> str | None:
    """The database's one revision; refused when its alembic_version holds several,
    which alembic cannot migrate from (and this history, with one head, never writes)."""
    revisions = MigrationContext.configure(connection).get_current_heads()
    if len(revisions) > 1:
        raise SchemaRevisionError(
            f"the database at {redacted_url(database_url)} has {len(revisions)} revisions in its "
            f"alembic_version table ({', '.join(revisions)}) where tiergate keeps one (its "
            f"newest is {', '.join(head_revisions())}): another application's migrations "
            "share the table, or it was edited. Give tiergate a database of its own, or "
            "leave only the row of the revision its schema is at"
        )
    return revisions[0] if revisions else None


def _url_of(config: Config) -> str:
    return str(config.get_main_option("sqlalchemy.url"))


def _known_current(config: Config, connection: Connection) -> str | None:
    """The database's revision, refused when these scripts do not know it: alembic can
    find no path from a revision it has never seen, in either direction."""
    current = _current(connection, _url_of(config))
    script = ScriptDirectory.from_config(config)
    if current is not None and current not in _revisions(script):
        raise SchemaRevisionError(_unknown_message(_url_of(config), current, script.get_heads()))
    return current


def _revisions(script: ScriptDirectory) -> set[str]:
    return {revision.revision for revision in script.walk_revisions()}


def _unknown_message(database_url: str, current: str, heads: Sequence[str]) -> str:
    # Unknown is all this release can tell: the revision of a newer release, or of
    # another application's migrations in the same database, read alike.
    newest = ", ".join(heads)
    return (
        f"the database at {redacted_url(database_url)} is at revision {current}, which this "
        f"release does not know (its newest is {newest}): if a newer release migrated it, "
        f"run that release, or migrate back with its tiergate migrate --revision {newest}; "
        "if another application did, give tiergate a database of its own"
    )


def _migrating(config: Config, current: str | None, run: Callable[[], None]) -> None:
    """Run an upgrade or downgrade; a statement the database refuses is one message
    naming the database, not the driver's traceback (the transaction rolls back)."""
    try:
        run()
    except DBAPIError as exc:
        # asyncpg's errors read "<class '...DuplicateTableError'>: relation ... exists".
        reason = re.sub(r"^<class '[^']*'>: ", "", str(exc.orig).splitlines()[0])
        hint = (
            "it holds tables but no tiergate revision: give tiergate an empty database "
            "of its own, or drop those tables"
            if current is None
            else f"its schema is not the one revision {current} made"
        )
        raise SchemaRevisionError(
            f"cannot migrate the database at {redacted_url(_url_of(config))}: {reason}; {hint}"
        ) from None


def upgrade_to_head(database_url: str) -> None:
    """Upgrade the database to the newest revision (creating the schema if empty)."""
    migrate_to(database_url, "head")


def downgrade_to(database_url: str, rev: str) -> None:
    """Downgrade to revision `rev` (`"base"` drops everything the migrations created)."""

    def downgrade(config: Config, connection: Connection) -> None:
        current = _known_current(config, connection)
        _migrating(config, current, lambda: command.downgrade(config, rev))

    _run(database_url, downgrade)


def migrate_to(database_url: str, revision: str = "head") -> str | None:
    """Upgrade or downgrade the database to `revision` (`"head"`, `"base"` or a revision
    id), whichever way it lies from the current one; returns the revision reached (None
    at base).

    Raises SchemaRevisionError for a revision these scripts do not know, the database's
    or the one asked for.
    """

    def migrate(config: Config, connection: Connection) -> str | None:
        current = _known_current(config, connection)
        script = ScriptDirectory.from_config(config)
        if revision == "base" or (
            current is not None and revision in _ancestry(script, current) - {current}
        ):
            _migrating(config, current, lambda: command.downgrade(config, revision))
        elif revision == "head" or revision in _revisions(script):
            _migrating(config, current, lambda: command.upgrade(config, revision))
        else:
            known = ", ".join(sorted(_revisions(script)))
            raise SchemaRevisionError(
                f"this release has no migration {revision!r}; it knows head, base and {known}"
            )
        return _current(connection, database_url)

    return _run(database_url, migrate)


def _ancestry(script: ScriptDirectory, revision: str) -> set[str]:
    """`revision` and every revision below it."""
    return {r.revision for r in script.iterate_revisions(revision, "base")}


def check_revision(database_url: str) -> None:
    """Raise SchemaRevisionError unless a process of this release can start on the
    database without upgrading it: at the newest revision, or at one this release does
    not know, which it takes for a newer one (the release before a contract step runs on
    the expanded schema of the next one). A process that upgrades the database itself
    calls upgrade_to_head instead."""
    current = current_revision(database_url)
    heads = head_revisions()
    if current in heads:
        return
    script = ScriptDirectory.from_config(alembic_config(database_url))
    if current is None or current in _revisions(script):
        raise SchemaRevisionError(
            f"the database is at revision {current or 'none'}; this release needs "
            f"{', '.join(heads)}: run tiergate migrate"
        )


def head_revisions() -> tuple[str, ...]:
    """The head revisions of the migration scripts (a healthy history has exactly one)."""
    return tuple(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())


def current_revision(database_url: str) -> str | None:
    """The revision the database is at, or None for an unmigrated database."""

    async def main() -> str | None:
        engine = create_db_engine(database_url)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(_current, database_url)
        finally:
            await engine.dispose()

    return _in_own_thread(lambda: asyncio.run(main()))
