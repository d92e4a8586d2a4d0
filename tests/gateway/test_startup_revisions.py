"""The schema revision at start-up and in `tiergate migrate`, with real processes: a
server refuses a database behind the code in one line and starts on one ahead of it;
`migrate` goes to any revision, up or down, refuses one it does not know, and two runs
at once on a fresh PostgreSQL database both succeed."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from gateway.db.session import create_db_engine
from gateway.migrate import current_revision, head_revisions, migrate_to, upgrade_to_head
from tests.gateway.conftest import execute_sql, output_until_started, run_cli

# A revision after this release's head: a database migrated by a newer release.
FUTURE = f"{int(head_revisions()[0]) + 1:04d}"

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/bin:/bin", "TIERGATE_DEVICE": "cpu"}


def _tiergate(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=ENV)


def _set_revision(url: str, revision: str) -> None:
    """What a newer release's migration leaves behind, as far as this one can tell."""

    async def update() -> None:
        engine = create_db_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    text("UPDATE alembic_version SET version_num = :v"), {"v": revision}
                )
        finally:
            await engine.dispose()

    asyncio.run(update())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_argv(command: str, url: str, redis_url: str, redis_prefix: str) -> list[str]:
    argv = [command, "--database-url", url, "--redis-url", redis_url]
    return [*argv, "--redis-prefix", redis_prefix, "--port", str(_free_port())]


@pytest.fixture
def postgres_url(postgres_databases) -> Iterator[str]:
    """A fresh, empty PostgreSQL database of this test's own."""
    url = postgres_databases.create()
    try:
        yield url
    finally:
        postgres_databases.drop(url)


@pytest.mark.parametrize("command", ["gateway", "serve"])
@pytest.mark.parametrize("revision", [None, "0005"], ids=["unmigrated", "older"])
def test_a_server_refuses_a_database_behind_the_code(
    postgres_url: str, redis_url: str, redis_prefix: str, command: str, revision: str | None
) -> None:
    if revision is not None:
        migrate_to(postgres_url, revision)
    ran = _tiergate(*_server_argv(command, postgres_url, redis_url, redis_prefix))
    assert ran.returncode == 2, ran.stderr[-3000:]
    # One line, before the engine loads (which would log) and before the tables are read.
    assert ran.stderr.splitlines() == [
        f"tiergate: error: the database is at revision {revision or 'none'}; this release "
        f"needs {head_revisions()[0]}: run tiergate migrate"
    ]
    assert current_revision(postgres_url) == revision  # checked, not migrated


@pytest.mark.slow
def test_a_gateway_starts_on_a_database_ahead_of_the_code(
    postgres_url: str, redis_url: str, redis_prefix: str
) -> None:
    """Expand, then contract: the release before runs on the next one's schema."""
    # An unmigrated database first: the same process is refused.
    argv = _server_argv("gateway", postgres_url, redis_url, redis_prefix)
    assert _tiergate(*argv).returncode == 2
    upgrade_to_head(postgres_url)
    _set_revision(postgres_url, FUTURE)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *argv],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = output_until_started(proc)
        assert "Application startup complete" in output, output[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_migrate_refuses_a_database_ahead_of_the_code(migrated_database_url: str) -> None:
    _set_revision(migrated_database_url, FUTURE)
    for argv in (["migrate"], ["migrate", "--revision", "0005"]):
        ran = _tiergate(*argv, "--database-url", migrated_database_url)
        assert ran.returncode == 2, ran.stderr[-3000:]
        [line] = ran.stderr.splitlines()
        assert f"is at revision {FUTURE}, which this release does not know" in line
    assert current_revision(migrated_database_url) == FUTURE


def test_serve_refuses_an_embedded_database_ahead_of_the_code(tmp_path: Path) -> None:
    """serve upgrades the embedded SQLite database on start; it cannot from a revision
    it does not know."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'tiergate.db'}"
    upgrade_to_head(url)
    _set_revision(url, FUTURE)
    ran = _tiergate("serve", "--data-dir", str(tmp_path), "--port", str(_free_port()))
    assert ran.returncode == 2, ran.stderr[-3000:]
    [line] = ran.stderr.splitlines()
    assert f"is at revision {FUTURE}, which this release does not know" in line


@pytest.mark.slow
def test_migrate_goes_to_a_revision_up_or_down(database_url: str) -> None:
    """The rollback of docs/deploy.md: the newer release takes the schema down."""
    head = head_revisions()[0]
    for argv, expected, said in [
        ([], head, "database is at the newest revision"),
        (["--revision", "0005"], "0005", "database is at revision 0005"),
        (["--revision", "base"], None, "database is at revision base"),
        (["--revision", "0003"], "0003", "database is at revision 0003"),
        (["--revision", head], head, f"database is at revision {head}"),
    ]:
        ran = _tiergate("migrate", "--database-url", database_url, *argv)
        assert ran.returncode == 0, (argv, ran.stderr[-3000:])
        assert ran.stdout.startswith(said), (argv, ran.stdout)
        assert current_revision(database_url) == expected, argv

    ran = _tiergate("migrate", "--database-url", database_url, "--revision", "0099")
    assert ran.returncode == 2
    [line] = ran.stderr.splitlines()
    assert "this release has no migration '0099'" in line
    assert current_revision(database_url) == head


# The command's own entry point, started once its imports are done: the runs then begin
# within milliseconds of each other, well inside the time one migration takes.
_ON_CUE = (
    "import sys; from gateway.cli import main; print('ready', flush=True); "
    "sys.stdin.readline(); sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.slow
def test_migrations_at_once_on_a_fresh_database(postgres_url: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ON_CUE, "migrate", "--database-url", postgres_url],
            cwd=ROOT,
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr[-3000:]
            assert "newest revision" in stdout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert current_revision(postgres_url) == head_revisions()[0]


def _execute(url: str, *statements: str) -> None:
    asyncio.run(execute_sql(url, *statements))


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def test_a_database_with_tables_but_no_revision_is_one_line(database_url: str) -> None:
    # Another application's table of the same name: the schema cannot be created there.
    _execute(database_url, "CREATE TABLE tenants (id int)")
    ran = _tiergate("migrate", "--database-url", database_url)
    assert ran.returncode == 2, ran.stderr[-3000:]
    [line] = ran.stderr.splitlines()
    assert line.startswith(
        f"tiergate: error: cannot migrate the database at {_redacted(database_url)}"
    )
    assert "tenants" in line
    assert "already exists" in line
    assert "tiergate migrate" in line or "database of its own" in line
    assert current_revision(database_url) is None  # nothing half-created stays behind


def test_serve_refuses_an_embedded_database_it_cannot_create_the_schema_in(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'tiergate.db'}"
    _execute(url, "CREATE TABLE tiers (id int)")
    ran = _tiergate("serve", "--data-dir", str(tmp_path), "--port", str(_free_port()))
    assert ran.returncode == 2, ran.stderr[-3000:]
    [line] = ran.stderr.splitlines()
    assert "cannot migrate the database at" in line
    assert "table tiers already exists" in line


def test_a_version_table_with_two_rows_is_one_line(migrated_database_url: str) -> None:
    _execute(migrated_database_url, "INSERT INTO alembic_version (version_num) VALUES ('abcd')")
    for argv in (
        ["migrate"],
        ["usage", "rebuild-rollup", "--start", "2025-06-01", "--end", "2025-06-02"],
    ):
        ran = _tiergate(*argv, "--database-url", migrated_database_url)
        assert ran.returncode == 2, (argv, ran.stderr[-3000:])
        [line] = ran.stderr.splitlines()
        assert f"the database at {_redacted(migrated_database_url)}" in line, line
        assert "alembic_version" in line
        assert "abcd" in line
        assert head_revisions()[0] in line


def test_a_revision_this_release_does_not_know_is_called_unknown(
    migrated_database_url: str,
) -> None:
    # 'abcd' is no revision of any tiergate release: another application's, perhaps.
    _set_revision(migrated_database_url, "abcd")
    ran = _tiergate("migrate", "--database-url", migrated_database_url)
    assert ran.returncode == 2, ran.stderr[-3000:]
    [line] = ran.stderr.splitlines()
    assert "revision abcd, which this release does not know" in line
    assert "newer than this release" not in line
    assert f"the database at {_redacted(migrated_database_url)}" in line
