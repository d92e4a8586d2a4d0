"""A live tiergate server for the HTTP tests: real uvicorn on a free port, in a thread.

One server per database (SQLite file, then a fresh PostgreSQL database) per test module,
not per test, so the suites stay fast. The server is the real composition root
(`build_app`) with the built-in tiny-random model; tenants and keys are created through
the real admin API.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from tests.conftest import REDIS_URL
from tests.fleet_processes import delete_redis_prefix

ROOT = Path(__file__).resolve().parents[2]
TEST_MAX_MODEL_LEN = 256
TEST_MAX_BODY_BYTES = 64 * 1024
TEST_TENANT_FILE_BYTES = 16 * 1024 * 1024  # a tenant's uploads in all: a 10 MB file fits
TIERS = ("priority", "interactive", "batch")


@dataclass
class LiveServer:
    base_url: str
    admin_token: str
    database_url: str
    engine: Any  # the AsyncEngine the server runs (tests read its stats)
    max_model_len: int = TEST_MAX_MODEL_LEN
    max_body_bytes: int = TEST_MAX_BODY_BYTES
    keys: dict[str, str] = field(default_factory=dict)  # tier -> API key of a tenant
    tenant_ids: dict[str, str] = field(default_factory=dict)  # tier -> tenant id
    suspended_key: str = ""
    redis_prefix: str | None = None  # the queue's key prefix on REDIS_URL; None: in memory
    # Every client handed out, closed with the server: a test that drops one would
    # otherwise leave its sockets to whichever later test the collector runs in.
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self, key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        """The official client, without retries (a retry would hide the first answer)."""
        client = openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=key if key is not None else self.keys["interactive"],
            max_retries=0,
            timeout=60,
            **kwargs,
        )
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.base_url}/admin/v1",
            headers={"authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )

    def new_key(self, tier: str = "interactive", **limits: int) -> str:
        """The key of a new tenant of `tier` with `limits` (its objects its own)."""
        with self.admin() as admin:
            name = f"tenant-{uuid.uuid4().hex[:8]}"
            tenant = admin.post("/tenants", json={"name": name, "tier": tier, **limits})
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
            return key.json()["secret"]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live_database_url(
    request: pytest.FixtureRequest, tmp_path_factory, postgres_databases
) -> Iterator[str]:
    """A database of this module's own: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        path = tmp_path_factory.mktemp("live-sqlite") / "tiergate.db"
        yield f"sqlite+aiosqlite:///{path}"
        return
    url = postgres_databases.create()
    try:
        yield url
    finally:
        postgres_databases.drop(url)


class ServerThread:
    """uvicorn serving an app on an already-bound socket, in a background thread."""

    def __init__(self, app: Any) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def start(self, timeout_s: float = 120.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
        self._socket.close()


def output_until_started(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    """A server process's output up to the end of its start-up (or its exit)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Application startup complete" in line:
            break
    return "".join(lines)


def reap(proc: subprocess.Popen) -> str:
    """Kill the process if it still runs; what it wrote that was not read yet."""
    if proc.poll() is None:
        proc.kill()
    if proc.stdout is not None and not proc.stdout.closed:
        return proc.communicate()[0] or ""
    return ""


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """`tiergate ARGS` in a process of its own, from the checkout; never raises on exit."""
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def build_test_engine() -> Any:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    return AsyncEngine(
        EngineConfig(
            model="tiny-random",
            device="cpu",
            max_model_len=TEST_MAX_MODEL_LEN,
            kv_cache_bytes=16 * 2**20,
        )
    )


def _create_tenants(server: LiveServer) -> None:
    with server.admin() as admin:
        for tier in TIERS:
            tenant = admin.post("/tenants", json={"name": f"live-{tier}", "tier": tier})
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
            server.keys[tier] = key.json()["secret"]
            server.tenant_ids[tier] = tenant.json()["id"]
        tenant = admin.post("/tenants", json={"name": "live-suspended", "tier": "interactive"})
        tenant.raise_for_status()
        tenant_id = tenant.json()["id"]
        key = admin.post(f"/tenants/{tenant_id}/keys", json={})
        key.raise_for_status()
        admin.patch(f"/tenants/{tenant_id}", json={"status": "suspended"}).raise_for_status()
        server.suspended_key = key.json()["secret"]


@pytest.fixture(scope="module")
def live_server(live_database_url: str, tmp_path_factory) -> Iterator[LiveServer]:
    """A running server on this module's database, with one tenant per tier."""
    from gateway.app import build_app
    from gateway.migrate import upgrade_to_head
    from gateway.settings import Settings

    if not live_database_url.startswith("sqlite"):
        upgrade_to_head(live_database_url)  # an operator runs `tiergate migrate`
    data_dir: Path = tmp_path_factory.mktemp("live-data")
    settings = Settings(
        data_dir=data_dir,
        database_url=live_database_url,
        admin_token=secrets.token_urlsafe(24),
        model="tiny-random",
        device="cpu",
        max_body_bytes=TEST_MAX_BODY_BYTES,
        tenant_file_bytes=TEST_TENANT_FILE_BYTES,
        usage_flush_interval_s=0.05,
    )
    engine = build_test_engine()
    thread = ServerThread(build_app(settings, engine=engine))
    thread.start()
    server = LiveServer(
        base_url=f"http://127.0.0.1:{thread.port}",
        admin_token=settings.admin_token or "",
        database_url=live_database_url,
        engine=engine,
    )
    try:
        _create_tenants(server)
        yield server
    finally:
        server.close_clients()
        thread.stop()


def paced_tier(admin: Any, **fields: Any) -> str:
    """Create, through `admin` (an admin API client), a preemptible tier whose batches
    run one line at a time (max_concurrency 1), so that a batch of long lines outlasts
    what a test does meanwhile on any machine; returns its name."""
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    tier = {"name": name, "rank": 9, "preemptible": True, "max_concurrency": 1, **fields}
    admin.post("/tiers", json=tier).raise_for_status()
    return name


@pytest.fixture(scope="module", params=["memory", "redis"])
def queue_server(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[LiveServer]:
    """A live server on SQLite with the in-memory queue, then with the Redis one (a key
    prefix of its own), and one interactive tenant's key."""
    from gateway.app import build_app
    from gateway.settings import Settings

    prefix = f"{{tgqueue-{uuid.uuid4().hex[:10]}}}:"
    redis_url = REDIS_URL if request.param == "redis" else None
    data_dir: Path = tmp_path_factory.mktemp("queue-data")
    settings = Settings(
        data_dir=data_dir,
        redis_url=redis_url,
        redis_prefix=prefix,
        admin_token=secrets.token_urlsafe(24),
        model="tiny-random",
        device="cpu",
        usage_flush_interval_s=0.05,
    )
    engine = build_test_engine()
    thread = ServerThread(build_app(settings, engine=engine))
    thread.start()
    served = LiveServer(
        f"http://127.0.0.1:{thread.port}",
        settings.admin_token or "",
        settings.db_url,
        engine,
        redis_prefix=prefix if redis_url is not None else None,
    )
    try:
        served.keys["interactive"] = served.new_key()
        yield served
    finally:
        served.close_clients()
        thread.stop()
        if redis_url is not None:
            delete_redis_prefix(REDIS_URL, prefix)


def run_one_line_batch(client: openai.OpenAI, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Run a batch of one line with `body` for `url` to completion; the line's result
    (its `response`, or its `error` if refused)."""
    line = {"custom_id": "only", "method": "POST", "url": url, "body": body}
    uploaded = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    file_id = batch.output_file_id or batch.error_file_id
    (result,) = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    return result


async def usage_rows(database_url: str, request_ids: list[str]) -> list[Any]:
    """The usage_records rows of `request_ids` (as many as are written yet)."""
    from sqlalchemy import select

    from gateway.db.models import UsageRow
    from gateway.db.session import create_db_engine, create_sessionmaker

    engine = create_db_engine(database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            query = select(UsageRow).where(UsageRow.request_id.in_(request_ids))
            return list((await session.scalars(query)).all())
    finally:
        await engine.dispose()


def wait_for_usage_rows(database_url: str, request_ids: list[str]) -> list[Any]:
    """The usage rows of `request_ids` once all are written (the writer batches them
    off the request path), or as many as there are after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        rows = asyncio.run(usage_rows(database_url, request_ids))
        if len(rows) >= len(request_ids) or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


async def execute_sql(url: str, *statements: str) -> None:
    """Run `statements` on the database at `url` in one transaction (setting up a state
    the product must meet, written as plain SQL)."""
    from sqlalchemy import text

    from gateway.db.session import create_db_engine

    engine = create_db_engine(url)
    try:
        async with engine.begin() as conn:
            for statement in statements:
                await conn.execute(text(statement))
    finally:
        await engine.dispose()
