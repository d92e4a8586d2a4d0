"""Batches survive their gateway: real server processes on PostgreSQL, killed mid-batch.

A second gateway on the same database does not touch a batch while its owner lives;
once the owner is SIGKILLed its lease lapses and the second one finishes the batch.
A gateway stopped gracefully hands its batch over at once. Either way the batch ends
with exactly one result line per custom_id, none missing, none twice.

The batch tier's concurrency limit paces the owner (a batch runs at most that many lines
at once), so the batch outlives the checks on any machine; it is lifted before each
takeover, and the gateway taking over reads the tier afresh.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest

from gateway.migrate import upgrade_to_head

POSTGRES = "postgresql://postgres@127.0.0.1:5432"
LEASE_S = 2.0
NUM_LINES = 120
PACED_CONCURRENCY = 1  # lines the owner runs at once while the test watches it
pytestmark = pytest.mark.slow


def _admin_sql(statement: str) -> None:
    import asyncio

    async def run() -> None:
        connection = await asyncpg.connect(f"{POSTGRES}/test", timeout=10)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(run())


def _fetch(database: str, query: str) -> list:
    import asyncio

    async def run() -> list:
        connection = await asyncpg.connect(f"{POSTGRES}/{database}", timeout=10)
        try:
            return list(await connection.fetch(query))
        finally:
            await connection.close()

    return asyncio.run(run())


@pytest.fixture
def database() -> Iterator[str]:
    name = f"tg_restart_{uuid.uuid4().hex[:12]}"
    _admin_sql(f'CREATE DATABASE "{name}"')
    try:
        upgrade_to_head(f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}")
        yield name
    finally:
        _admin_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gateway:
    """`tiergate serve` in its own process."""

    def __init__(self, database: str, admin_token: str, data_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "TIERGATE_DATABASE_URL": f"postgresql+asyncpg://postgres@127.0.0.1:5432/{database}",
            "TIERGATE_ADMIN_TOKEN": admin_token,
            "TIERGATE_DATA_DIR": str(data_dir),
            "TIERGATE_MODEL": "tiny-random",
            "TIERGATE_DEVICE": "cpu",
            "TIERGATE_MAX_MODEL_LEN": "256",
            "TIERGATE_KV_CACHE_BYTES": str(16 * 2**20),
            "TIERGATE_BATCH_LEASE_S": str(LEASE_S),
        }
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / "gateway.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_s: float = 120.0) -> Gateway:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{log}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the gateway did not start")

    def stop(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=60)


@pytest.fixture
def gateways(database: str, tmp_path: Path) -> Iterator[tuple[str, str, list[Gateway]]]:
    started: list[Gateway] = []
    token = secrets.token_urlsafe(16)
    try:
        yield database, token, started
    finally:
        for gateway in started:
            gateway.stop(signal.SIGKILL)


def _key(gateway: Gateway, token: str) -> str:
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"{gateway.url}/admin/v1", headers=headers) as admin:
        tenant = admin.post("/tenants", json={"name": "nightly", "tier": "batch"})
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
        return key.json()["secret"]


def _pace_batch_tier(gateways: list[Gateway], token: str, max_concurrency: int | None) -> None:
    """Set the batch tier's concurrency limit through each gateway's admin API.

    Each admin write drops that gateway's own tier cache, so all of them see the limit
    at once, whoever owns or takes over the batch.
    """
    headers = {"authorization": f"Bearer {token}"}
    for gateway in gateways:
        response = httpx.patch(
            f"{gateway.url}/admin/v1/tiers/batch",
            json={"max_concurrency": max_concurrency},
            headers=headers,
            timeout=10,
        )
        response.raise_for_status()


def _client(gateway: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30)


def _submit(client: openai.OpenAI) -> str:
    lines = [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-random",
                "messages": [{"role": "user", "content": f"Summarise record {i}."}],
                "max_tokens": 200,
                "temperature": 0,
            },
        }
        for i in range(NUM_LINES)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("rows.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def _wait_until(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _owner(database: str, batch_id: str) -> str | None:
    [row] = _fetch(database, f"SELECT owner FROM batches WHERE id = '{batch_id}'")
    return row["owner"]


def _assert_exactly_once(client: openai.OpenAI, database: str, batch_id: str) -> None:
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed"
    assert batch.request_counts.total == NUM_LINES
    ids = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            text = client.files.content(file_id).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines()]
    assert sorted(ids) == sorted(f"row-{i}" for i in range(NUM_LINES))
    pending = _fetch(
        database,
        f"SELECT count(*) AS n FROM batch_lines WHERE batch_id = '{batch_id}' "
        "AND status = 'pending'",
    )
    assert pending[0]["n"] == 0
    assert _owner(database, batch_id) is None


def test_sigkill_mid_batch_and_takeover(gateways, tmp_path: Path) -> None:
    database, token, started = gateways
    for name in ("a", "b"):
        started.append(Gateway(database, token, tmp_path / name))
    for gateway in started:
        gateway.wait_ready()
    key = _key(started[0], token)
    client = _client(started[0], key)
    _pace_batch_tier(started, token, PACED_CONCURRENCY)
    batch_id = _submit(client)
    _wait_until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 3)

    # Two replicas, one owner; the other leaves the batch alone while the owner lives.
    owner = _owner(database, batch_id)
    assert owner is not None
    by_pid = {str(g.process.pid): g for g in started}
    owner_gateway = by_pid[owner.split(":")[1]]
    survivor = next(g for g in started if g is not owner_gateway)
    time.sleep(LEASE_S * 1.5)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "in_progress", "the batch finished too early; make it longer"
    assert _owner(database, batch_id) == owner

    _pace_batch_tier([survivor], token, None)
    owner_gateway.stop(signal.SIGKILL)
    client = _client(survivor, key)
    _wait_until(lambda: client.batches.retrieve(batch_id).status == "completed")
    _assert_exactly_once(client, database, batch_id)

    # A graceful stop releases the lease: a waiting gateway takes over without the lapse.
    third = Gateway(database, token, tmp_path / "c")
    started.append(third)
    third.wait_ready()
    _pace_batch_tier([survivor, third], token, PACED_CONCURRENCY)
    batch_id = _submit(client)
    _wait_until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 3)
    assert client.batches.retrieve(batch_id).status == "in_progress"
    _pace_batch_tier([third], token, None)
    survivor.stop(signal.SIGTERM)
    # Released on the way out: free, or already taken by the third gateway.
    after = _owner(database, batch_id)
    assert after is None or after.split(":")[1] == str(third.process.pid)
    client = _client(third, key)
    _wait_until(lambda: client.batches.retrieve(batch_id).status == "completed")
    _assert_exactly_once(client, database, batch_id)
    # The line the stop broke off runs again; only that run is billed.
    aborted = _fetch(database, "SELECT count(*) FROM usage_records WHERE outcome = 'aborted'")
    assert aborted[0][0] == 0
