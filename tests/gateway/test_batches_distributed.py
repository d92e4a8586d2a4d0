"""The Batch API on a Redis fleet: `tiergate gateway` and `tiergate worker` processes.

Two workers and two gateways share one PostgreSQL database and one Redis (under a key
prefix of this module), with the tiny-random model on the CPU. Checked here: a worker
SIGKILLed while it holds leased lines of a batch loses nothing and duplicates nothing
(greedy results equal an undisturbed run's); a batch tier whose queue cap is reached
leaves lines pending and retries them rather than failing them; cancel and expiry end
the batch and drain its jobs from the shared queue; a gateway SIGKILLed mid-batch has
its batch taken over by the other gateway. Every batch ends with exactly one result
line per custom_id.

The machine running this may have two cores shared by every process here, so the
batches are small (tens of lines, few tokens) and each process runs one torch thread.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
import redis

from scheduler.keys import FAMILIES, KeySpace
from tests.conftest import REDIS_URL
from tests.fleet_processes import (
    fleet_setup,
    free_port,
    spawn_tiergate,
    spawn_worker,
    stop_processes,
    wait_ready,
)
from tests.gateway.conftest import paced_tier

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
CHAT = "/v1/chat/completions"
LEASE_MS = 3000  # a SIGKILLed worker's jobs are resumed elsewhere after this
BATCH_LEASE_S = 2.0  # a SIGKILLed gateway's batches are taken over after this
MAX_NUM_SEQS = 4  # per worker, so that a batch's lines wait in the shared queue
NUM_LINES = 24
MAX_TOKENS = 24
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass
class Fleet:
    database_url: str
    admin_token: str
    prefix: str
    env: dict[str, str]
    logs: Path
    gateways: dict[str, subprocess.Popen] = field(default_factory=dict)  # URL -> process
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)  # worker id -> process

    def start_worker(self, name: str) -> None:
        self.workers[name] = spawn_worker(
            name, self.env, self.logs, max_num_seqs=MAX_NUM_SEQS, lease_ms=LEASE_MS
        )

    def start_gateway(self) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = self.logs / f"gateway-{port}.log"
        self.gateways[url] = spawn_tiergate(["gateway", f"--port={port}"], self.env, log)
        return url

    @property
    def live_gateways(self) -> list[str]:
        return [url for url, proc in self.gateways.items() if proc.poll() is None]

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.live_gateways[0]}/admin/v1",
            headers={"authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )

    def tenant(self, tier: str = "batch") -> tuple[str, str]:
        """A fresh tenant of `tier`: its id and an API key."""
        with self.admin() as admin:
            tenant = admin.post(
                "/tenants", json={"name": f"b-{uuid.uuid4().hex[:8]}", "tier": tier}
            )
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
        return tenant.json()["id"], key.json()["secret"]

    def client(self, key: str, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url or self.live_gateways[0]}/v1", api_key=key, max_retries=0, timeout=60
        )

    def sql(self, query: str, *args: Any) -> list[Any]:
        async def run() -> list[Any]:
            dsn = self.database_url.replace("postgresql+asyncpg", "postgresql")
            connection = await asyncpg.connect(dsn, timeout=10)
            try:
                return list(await connection.fetch(query, *args))
            finally:
                await connection.close()

        return asyncio.run(run())

    def jobs(self) -> list[dict[str, str]]:
        """Every job record in this fleet's Redis (queued, leased or recently ended)."""
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            start = len(KeySpace(self.prefix).job(""))
            pattern = KeySpace(self.prefix).pattern()[:-1] + FAMILIES["job"] + "*"
            return [
                {**client.hgetall(name), "id": name[start:]}
                for name in client.scan_iter(match=pattern, count=500)
            ]
        finally:
            client.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    with fleet_setup(
        tmp_path_factory, "batch", REDIS_URL, TIERGATE_BATCH_LEASE_S=str(BATCH_LEASE_S)
    ) as setup:
        fleet = Fleet(setup.database_url, setup.admin_token, setup.prefix, setup.env, setup.logs)
        try:
            for name in ("w1", "w2"):
                fleet.start_worker(name)
            for _ in range(2):
                fleet.start_gateway()
            procs = [*fleet.workers.values(), *fleet.gateways.values()]
            for url in fleet.gateways:
                wait_ready(url, procs)
            yield fleet
        finally:
            stop_processes([*fleet.workers.values(), *fleet.gateways.values()])


# --------------------------------------------------------------------------- helpers
def _lines(n: int = NUM_LINES, max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Summarise record {i}."}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def _submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("rows.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h"
    ).id


def _until(predicate: Callable[[], Any], timeout_s: float = 120.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.1)


def _wait_terminal(client: openai.OpenAI, batch_id: str, timeout_s: float = 180.0) -> Any:
    def ended() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in TERMINAL else None

    return _until(ended, timeout_s, f"batch {batch_id} to end")


def _results(client: openai.OpenAI, batch: Any, n: int) -> tuple[dict, dict]:
    """Output and error lines by custom_id, after checking each custom_id has one."""
    by_file = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        text = client.files.content(file_id).text if file_id else ""
        by_file.append([json.loads(line) for line in text.splitlines()])
    ids = [r["custom_id"] for r in by_file[0] + by_file[1]]
    assert sorted(ids) == sorted(f"row-{i}" for i in range(n))  # none missing, none twice
    assert batch.request_counts.total == n
    assert batch.request_counts.completed == len(by_file[0])
    assert batch.request_counts.failed == len(by_file[1])
    return ({r["custom_id"]: r for r in by_file[0]}, {r["custom_id"]: r for r in by_file[1]})


def _answers(output: dict) -> dict[str, tuple[str, int, int]]:
    """What greedy decoding decides per line: the text and the token counts."""
    answers = {}
    for custom_id, line in output.items():
        body = line["response"]["body"]
        usage = body["usage"]
        text = body["choices"][0]["message"]["content"]
        answers[custom_id] = (text, usage["prompt_tokens"], usage["completion_tokens"])
    return answers


def _tenant_jobs(fleet: Fleet, tenant_id: str, states: tuple[str, ...]) -> list[dict]:
    return [j for j in fleet.jobs() if j.get("tenant") == tenant_id and j.get("st") in states]


def _assert_drained(fleet: Fleet, tenant_id: str, timeout_s: float = 15.0) -> None:
    """None of the tenant's jobs is left queued or running on a worker."""
    deadline = time.monotonic() + timeout_s
    while left := _tenant_jobs(fleet, tenant_id, ("queued", "leased")):
        if time.monotonic() > deadline:
            # What the gateway recorded for them says how their lines let go of them.
            ids = [j["id"] for j in left]
            usage = fleet.sql(
                "SELECT request_id, outcome FROM usage_records WHERE request_id = ANY($1)", ids
            )
            states = [(j["id"], j.get("st"), j.get("wk")) for j in left]
            raise AssertionError(f"{len(left)} jobs left: {states}; usage: {usage}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> dict[str, tuple[str, int, int]]:
    """The lines' results from an undisturbed run on the same fleet."""
    _tenant_id, key = fleet.tenant()
    client = fleet.client(key)
    batch = _wait_terminal(client, _submit(client, _lines()))
    assert batch.status == "completed"
    output, errors = _results(client, batch, NUM_LINES)
    assert not errors
    answers = _answers(output)
    assert all(completion > 0 for _, _, completion in answers.values())
    return answers


# --------------------------------------------------------------------------- tests
def test_worker_sigkill_mid_batch_loses_and_duplicates_nothing(fleet: Fleet, reference) -> None:
    tenant_id, key = fleet.tenant()
    client = fleet.client(key)
    batch_id = _submit(client, _lines())

    # Kill a worker while it holds leased lines of this batch, after some have finished.
    def leased() -> list[dict]:
        if client.batches.retrieve(batch_id).request_counts.completed < 2:
            return []
        return _tenant_jobs(fleet, tenant_id, ("leased",))

    victim = _until(leased, 120, "a leased line")[0]["wk"]
    fleet.workers[victim].kill()  # SIGKILL: no drain, no requeue
    fleet.workers[victim].wait()
    assert client.batches.retrieve(batch_id).status == "in_progress", "make the batch longer"

    batch = _wait_terminal(client, batch_id)
    assert batch.status == "completed"
    output, errors = _results(client, batch, NUM_LINES)
    assert not errors
    assert _answers(output) == reference  # resumed lines continue where they stopped
    fleet.start_worker(victim)  # back to two workers for the next tests (not waited for)


def test_full_batch_queue_leaves_lines_pending_and_retries_them(fleet: Fleet) -> None:
    _tenant_id, key = fleet.tenant()
    cap = 2

    keys = KeySpace(fleet.prefix)
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)

    def set_cap(max_queued_jobs: int | None) -> None:
        """The batch tier's queue cap, set as an operator does (the admin API), once the
        queue enforces it."""
        with fleet.admin() as admin:
            admin.patch(
                "/tiers/batch", json={"max_queued_jobs": max_queued_jobs}
            ).raise_for_status()
        expected = None if max_queued_jobs is None else str(max_queued_jobs)
        _until(
            lambda: store.hget(keys.tier_policy, "max_queued:batch") == expected or None,
            timeout_s=1,
            what="the cap to reach the queue",
        )

    with fleet.admin() as admin:
        seeded_cap = admin.get("/tiers/batch").json()["max_queued_jobs"]
    set_cap(cap)
    workers = list(fleet.workers.values())
    depth_key = keys.depth
    try:
        client = fleet.client(key)
        # Paused workers lease nothing, so the queue must fill to the cap and stop there
        # (well inside the workers' capacity TTL, so the fleet stays live).
        for worker in workers:
            worker.send_signal(signal.SIGSTOP)
        try:
            batch_id = _submit(client, _lines())
            _until(
                lambda: int(store.hget(depth_key, "batch") or 0) >= cap or None,
                timeout_s=30,
                what="the batch tier's queue to fill to its cap",
            )
            held = []
            for _ in range(10):  # the driver keeps retrying refused lines meanwhile
                held.append(int(store.hget(depth_key, "batch") or 0))
                time.sleep(0.05)
            assert held == [cap] * len(held)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGCONT)
        max_depth = cap
        while client.batches.retrieve(batch_id).status not in TERMINAL:
            max_depth = max(max_depth, int(store.hget(depth_key, "batch") or 0))
            time.sleep(0.05)
    finally:
        set_cap(seeded_cap)
        store.close()
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed"
    output, errors = _results(client, batch, NUM_LINES)
    assert not errors  # refused lines were retried, none failed
    assert len(output) == NUM_LINES
    assert max_depth == cap  # reached while the workers were paused, never passed


def test_a_batch_puts_back_the_tier_table_a_restarted_redis_lost(fleet: Fleet) -> None:
    # Redis restarted empty, as far as the tier table goes, and nothing but this batch
    # runs: its lines met "tier not configured" again and again (14,000 log lines in
    # 10 minutes) until a request of another kind put the table back.
    _tenant_id, key = fleet.tenant()
    keys = KeySpace(fleet.prefix)
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        store.delete(keys.tiers, keys.tier_policy)
        client = fleet.client(key)
        batch = _wait_terminal(client, _submit(client, _lines()), timeout_s=60)
        assert batch.status == "completed"
        output, errors = _results(client, batch, NUM_LINES)
        assert not errors
        assert len(output) == NUM_LINES
        assert store.hexists(keys.tiers, "batch")
    finally:
        store.close()


def test_cancel_ends_the_batch_and_drains_its_jobs(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        tenant_id, key = fleet.tenant(paced_tier(admin))
    client = fleet.client(key)
    n = 40
    batch_id = _submit(client, _lines(n, max_tokens=200))
    _until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 2, 120)
    assert client.batches.cancel(batch_id).status in ("cancelling", "cancelled")
    batch = _wait_terminal(client, batch_id)
    assert batch.status == "cancelled"
    output, errors = _results(client, batch, n)
    assert output
    assert errors, "the batch finished before the cancel; make the lines longer"
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    # Its queued lines left the queue and its running ones were aborted on the workers.
    _assert_drained(fleet, tenant_id)


def test_expiry_ends_the_batch_and_drains_its_jobs(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        tenant_id, key = fleet.tenant(paced_tier(admin, completion_window_s=3))
    client = fleet.client(key)
    n = 40
    batch_id = _submit(client, _lines(n, max_tokens=200))
    batch = _wait_terminal(client, batch_id)
    assert batch.status == "expired"
    _output, errors = _results(client, batch, n)
    assert errors
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
    _assert_drained(fleet, tenant_id)


def test_gateway_sigkill_mid_batch_and_takeover(fleet: Fleet, reference) -> None:
    """Last in the module: it leaves one gateway."""
    _tenant_id, key = fleet.tenant()
    client = fleet.client(key)
    batch_id = _submit(client, _lines())
    _until(lambda: client.batches.retrieve(batch_id).request_counts.completed >= 2, 120)
    [row] = fleet.sql("SELECT owner FROM batches WHERE id = $1", batch_id)
    owner_pid = int(row["owner"].split(":")[1])
    [owner_url] = [url for url, p in fleet.gateways.items() if p.pid == owner_pid]
    fleet.gateways[owner_url].kill()  # SIGKILL: its lease on the batch is left to lapse
    fleet.gateways[owner_url].wait()
    survivor = fleet.client(key, fleet.live_gateways[0])
    assert survivor.batches.retrieve(batch_id).status == "in_progress", "make the batch longer"
    batch = _wait_terminal(survivor, batch_id)
    assert batch.status == "completed"
    output, errors = _results(survivor, batch, NUM_LINES)
    assert not errors
    assert _answers(output) == reference
    [row] = fleet.sql("SELECT owner FROM batches WHERE id = $1", batch_id)
    assert row["owner"] is None
