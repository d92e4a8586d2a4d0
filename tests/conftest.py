"""Shared fixtures: real databases (SQLite and PostgreSQL) and a real Redis.

Every test gets its own database (a SQLite file in tmp_path, or a fresh PostgreSQL
database created and dropped around it) and its own Redis key prefix, so tests of
different packages can run at the same time against the same servers.

Servers default to the local ones; override with TIERGATE_TEST_POSTGRES_URL (an
SQLAlchemy URL of a database the fixture may connect to in order to create others) and
TIERGATE_TEST_REDIS_URL.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

# Without a GPU the Triton kernels are tested under Triton's interpreter, and
# kernels/_triton.py imports Triton only with it switched on: before the first import of
# the kernels, which any test module may make.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

POSTGRES_URL = os.environ.get(
    "TIERGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("TIERGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _run_async(make_coro: Callable[[], Any]) -> Any:
    """Run a coroutine to completion on a private thread and loop.

    Sync fixtures run while pytest-asyncio owns the main thread's event loop; a private
    thread keeps asyncio.run from replacing or closing that loop.
    """
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(make_coro())
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _asyncpg_dsn(sqlalchemy_url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(False)


def _create_postgres_database(template: str | None = None) -> str:
    """Create a database (empty, or a copy of `template`); return its SQLAlchemy URL."""
    import asyncpg

    name = f"tg_test_{uuid.uuid4().hex[:16]}"
    clause = f' TEMPLATE "{template}"' if template else ""

    async def create() -> None:
        connection = await asyncpg.connect(_asyncpg_dsn(POSTGRES_URL), timeout=10)
        try:
            await connection.execute(f'CREATE DATABASE "{name}"{clause}')
        finally:
            await connection.close()

    _run_async(create)
    return postgres_url_named(name)


def postgres_url_named(database: str) -> str:
    """The test PostgreSQL server's SQLAlchemy URL with another database name."""
    from sqlalchemy.engine import make_url

    return make_url(POSTGRES_URL).set(database=database).render_as_string(False)


def _drop_postgres_database(url: str) -> None:
    import asyncpg
    from sqlalchemy.engine import make_url

    name = make_url(url).database

    async def drop() -> None:
        connection = await asyncpg.connect(_asyncpg_dsn(POSTGRES_URL), timeout=10)
        try:
            # FORCE: a test that leaked a connection must not leak its database too.
            await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await connection.close()

    _run_async(drop)


@dataclass(frozen=True)
class PostgresDatabases:
    """Creates and drops throwaway PostgreSQL databases, for fixtures of any scope."""

    create: Callable[..., str]  # create(template=None) -> SQLAlchemy URL
    drop: Callable[[str], None]


@pytest.fixture(scope="session")
def postgres_databases() -> PostgresDatabases:
    return PostgresDatabases(create=_create_postgres_database, drop=_drop_postgres_database)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """An empty database of its own, as an async SQLAlchemy URL (SQLite, then PostgreSQL)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'tiergate.db'}"
        return
    url = _create_postgres_database()
    try:
        yield url
    finally:
        _drop_postgres_database(url)


@pytest.fixture(scope="session")
def _migrated_templates(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Migrated databases built once per session and copied for each test (migrating
    every test's database from scratch would dominate the run time)."""

    templates: dict[str, str] = {}
    try:
        yield templates
    finally:
        if "postgresql" in templates:
            _drop_postgres_database(templates["postgresql"])


def _template_for(kind: str, templates: dict[str, str], tmp_path_factory) -> str:
    from gateway.migrate import upgrade_to_head

    if kind not in templates:
        if kind == "sqlite":
            url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('template') / 'tiergate.db'}"
        else:
            url = _create_postgres_database()
        upgrade_to_head(url)
        templates[kind] = url
    return templates[kind]


@pytest.fixture(params=["sqlite", "postgresql"])
def migrated_database_url(
    request: pytest.FixtureRequest, tmp_path, tmp_path_factory, _migrated_templates
) -> Iterator[str]:
    """A database of its own at the newest migration (seeded tiers included)."""
    import shutil

    from sqlalchemy.engine import make_url

    template = _template_for(request.param, _migrated_templates, tmp_path_factory)
    if request.param == "sqlite":
        path = tmp_path / "tiergate.db"
        shutil.copyfile(make_url(template).database, path)
        yield f"sqlite+aiosqlite:///{path}"
        return
    url = _create_postgres_database(template=make_url(template).database)
    try:
        yield url
    finally:
        _drop_postgres_database(url)


@pytest.fixture
async def db_sessionmaker(migrated_database_url: str) -> AsyncIterator[Any]:
    """An async_sessionmaker on a migrated database of this test's own."""
    from gateway.db.session import create_db_engine, create_sessionmaker

    engine = create_db_engine(migrated_database_url)
    try:
        yield create_sessionmaker(engine)
    finally:
        await engine.dispose()


@pytest.fixture
def redis_url() -> str:
    """URL of the shared test Redis; isolate keys with `redis_prefix`."""
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix unique to this test; its keys are deleted afterwards."""
    import redis

    prefix = f"tgtest:{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


# --------------------------------------------------------------------------- fleet logs
_LOG_OFFSETS = pytest.StashKey[dict]()
_LOG_TAIL_BYTES = 6000


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.fleet_processes import SPAWNED_LOGS

    item.stash[_LOG_OFFSETS] = {log: _size(log) for log in SPAWNED_LOGS}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failing test's report ends with what each spawned process (a worker, a
    gateway, a redis-server) wrote while it ran: the fault is often in their logs."""
    report = yield
    if report.failed and call.when == "call":
        from tests.fleet_processes import SPAWNED_LOGS

        offsets = item.stash.get(_LOG_OFFSETS, {})
        for log in sorted(SPAWNED_LOGS):
            start = offsets.get(log, 0)
            if _size(log) <= start:
                continue
            with log.open("rb") as f:
                f.seek(max(start, _size(log) - _LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
            report.sections.append((f"log of {log.parent.name}/{log.name}", text))
    return report


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
