"""A fleet losing a piece: Redis stalling, a gateway or every worker SIGKILLed.

Two `tiergate gateway` and two `tiergate worker` processes on a PostgreSQL database and
a redis-server of this module's own (so that it can be paused), the tiny-random model on
the CPU. Checked here, each against real processes and the jobs' records in Redis:

- Redis stalls past the gateways' presence TTL but within their timeouts: every request
  completes, none is abandoned. It stalls past their socket timeout: the clients
  answered with an error have their jobs cancelled once Redis is back (none runs on for
  nobody).
- A gateway is SIGKILLed with streams in flight and more queued, and a batch it drives:
  its jobs stop within seconds (abandoned: its presence lapsed), instead of running to
  their end; the other gateway takes the batch over and runs each line once more, and
  the batch ends with one result per line; it also bills the dead gateway's requests
  that left the queue, for what their streams hold.
- The only worker is SIGKILLed mid-request: the client gets 503 `no_capacity` within a
  bound; when a worker comes back before that bound, the request completes normally.

Requests are long (eos biased away, so greedy decoding runs to max_tokens) so that the
work outlasts what each test measures on any machine.
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
from typing import Any

import asyncpg
import httpx
import openai
import pytest
import redis

from scheduler.keys import FAMILIES, KeySpace
from tests.fleet_processes import (
    RedisServer,
    fleet_setup,
    free_port,
    spawn_tiergate,
    spawn_worker,
    stop_processes,
    wait_ready,
)

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
PROMPT = "hello there"
# tiny-random's eos token: biased away, greedy decoding runs to max_tokens.
EOS_BIAS = {"3": -100}
MAX_MODEL_LEN = 1024
LONG = 1000  # tokens: several seconds of a worker's time per request
LEASE_MS = 3000
MAX_NUM_SEQS = 4  # per worker: the queue holds the rest
# Seconds Redis stands still: longer than the gateways' presence TTL (5 s) and shorter
# than their socket timeout (10 s), so that nobody is answered with an error; then
# longer than that timeout, so that their reads fail and clients get errors.
SHORT_REDIS_PAUSE_S = 7.0
LONG_REDIS_PAUSE_S = 12.0
# After Redis is back, a job whose client got an error may still stream what was in
# flight (a worker's publish waiting in the socket) and until its deferred cancel lands
# (a second); never for the seconds it would take to run on.
AFTER_RESUME_MS = 3000
# A SIGKILLed gateway's jobs stop within its presence TTL (5 s), a worker's heartbeat
# (1 s), the queue's grace (2 s) and another heartbeat: 9 s, and slack for this CPU.
GATEWAY_DEATH_BOUND_MS = 15_000
# A SIGKILLed gateway's batches are taken over after this (the default is 10 s).
BATCH_LEASE_S = 3.0
NUM_BATCH_LINES = 48
# A request whose only worker died is answered within the worker's report TTL (5 s), the
# gateway's no-worker grace (5 s) and its watch round (1 s): 11 s, and slack.
NO_WORKER_BOUND_S = 20.0


@dataclass
class Fleet:
    redis: RedisServer
    database_url: str
    prefix: str
    admin_token: str
    gateways: list[str] = field(default_factory=list)  # base URLs
    gateway_procs: list[subprocess.Popen] = field(default_factory=list)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.gateways[0]}/admin/v1",
            headers={"authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )

    def tenant(self, tier: str = "chaos") -> tuple[str, str]:
        """A fresh tenant of `tier`: its id and an API key."""
        with self.admin() as admin:
            tenant = admin.post(
                "/tenants",
                json={"name": f"c-{uuid.uuid4().hex[:8]}", "tier": tier, "max_concurrency": 500},
            )
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
        return tenant.json()["id"], key.json()["secret"]

    def queues(self) -> dict:
        with self.admin() as admin:
            reply = admin.get("/queues")
            reply.raise_for_status()
            return reply.json()

    def store(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, decode_responses=True)

    def jobs(self, tenant_id: str | None = None) -> dict[str, dict[str, str]]:
        """The job records in Redis (queued, leased or recently ended) of a tenant, or of
        everyone, by id."""
        keys = KeySpace(self.prefix)
        start = len(keys.job(""))
        pattern = keys.pattern()[:-1] + FAMILIES["job"] + "*"
        with self.store() as store:
            records = {
                name[start:]: store.hgetall(name)
                for name in store.scan_iter(match=pattern, count=500)
            }
        return {i: r for i, r in records.items() if tenant_id in (None, r.get("tenant"))}

    def batch_owner(self, batch_id: str) -> str | None:
        async def read() -> str | None:
            dsn = self.database_url.replace("postgresql+asyncpg", "postgresql")
            connection = await asyncpg.connect(dsn, timeout=10)
            try:
                return await connection.fetchval(
                    "SELECT owner FROM batches WHERE id = $1", batch_id
                )
            finally:
                await connection.close()

        return asyncio.run(read())

    def usage(self, tenant_id: str) -> dict[str, tuple[str, int, int]]:
        """The tenant's usage records: request id -> (outcome, prompt, completion)."""

        async def read() -> dict[str, tuple[str, int, int]]:
            dsn = self.database_url.replace("postgresql+asyncpg", "postgresql")
            connection = await asyncpg.connect(dsn, timeout=10)
            try:
                rows = await connection.fetch(
                    "SELECT request_id, outcome, prompt_tokens, completion_tokens "
                    "FROM usage_records WHERE tenant_id = $1",
                    tenant_id,
                )
            finally:
                await connection.close()
            return {r[0]: (r[1], r[2], r[3]) for r in rows}

        return asyncio.run(read())

    def streamed_tokens(self, job_id: str) -> int:
        """The tokens in the job's result stream."""
        with self.store() as store:
            entries = store.xrange(KeySpace(self.prefix).results(job_id))
        return sum(len(f["t"].split(",")) for _, f in entries if f.get("t"))

    def last_token_ms(self, job_id: str) -> int | None:
        """When (Redis's clock) the job's last tokens reached its result stream."""
        with self.store() as store:
            for entry_id, fields in store.xrevrange(KeySpace(self.prefix).results(job_id)):
                if fields.get("k") == "tokens":
                    return int(entry_id.split("-")[0])
        return None

    def now_ms(self) -> int:
        with self.store() as store:
            seconds, micros = store.time()
        return seconds * 1000 + micros // 1000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    server = RedisServer(tmp_path_factory.mktemp("chaos-redis") / "redis.log")
    server.start()
    try:
        with fleet_setup(
            tmp_path_factory,
            "chaos",
            server.url,
            TIERGATE_MAX_MODEL_LEN=str(MAX_MODEL_LEN),
            TIERGATE_BATCH_LEASE_S=str(BATCH_LEASE_S),
        ) as setup:
            fleet = Fleet(server, setup.database_url, setup.prefix, setup.admin_token)
            procs: list[subprocess.Popen] = []
            try:
                for name in ("w1", "w2"):
                    fleet.workers[name] = spawn_worker(
                        name, setup.env, setup.logs, max_num_seqs=MAX_NUM_SEQS, lease_ms=LEASE_MS
                    )
                    procs.append(fleet.workers[name])
                for i in range(2):
                    port = free_port()
                    gateway = spawn_tiergate(
                        ["gateway", f"--port={port}"], setup.env, setup.logs / f"gateway{i}.log"
                    )
                    procs.append(gateway)
                    fleet.gateway_procs.append(gateway)
                    fleet.gateways.append(f"http://127.0.0.1:{port}")
                for url in fleet.gateways:
                    wait_ready(url, procs)
                with fleet.admin() as admin:
                    # No SLO, no queue limit: the queue keeps whatever arrives.
                    admin.post("/tiers", json={"name": "chaos", "rank": 1}).raise_for_status()
                _, key = fleet.tenant()
                for url in fleet.gateways:  # the engines' first steps are slow
                    warm = httpx.post(
                        f"{url}/v1/completions",
                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8},
                        headers={"authorization": f"Bearer {key}"},
                        timeout=60,
                    )
                    warm.raise_for_status()
                yield fleet
            finally:
                for proc in procs:  # a paused worker would drain only once resumed
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGCONT)
                stop_processes(procs)
    finally:
        server.stop()


# --------------------------------------------------------------------------- clients
@dataclass
class Outcome:
    """One request as its client saw it."""

    request_id: str
    status: int
    num_tokens: int = 0  # completion tokens (usage) of a request that completed
    text: str = ""
    error: str | None = None  # the error code, "disconnected", or None when completed
    message: str = ""  # the error's
    answered_s: float = 0.0  # monotonic: when the client had its answer


async def _request(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    max_tokens: int,
    *,
    stream: bool = True,
    started: asyncio.Event | None = None,
) -> Outcome:
    """One completion; `started` is set at its first token."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": EOS_BIAS,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    outcome = Outcome("", 0)
    try:
        async with http.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
        ) as response:
            outcome.request_id = response.headers.get("x-request-id", "")
            outcome.status = response.status_code
            if response.status_code != 200 or not stream:
                reply = json.loads(await response.aread())
                if "error" in reply:
                    outcome.error = reply["error"]["code"]
                    outcome.message = reply["error"]["message"]
                else:
                    outcome.num_tokens = reply["usage"]["completion_tokens"]
                    outcome.text = reply["choices"][0]["text"]
                return outcome
            pieces = []
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = chunk["error"]["code"]
                    outcome.message = chunk["error"]["message"]
                    return outcome
                if chunk.get("choices"):
                    pieces.append(chunk["choices"][0]["text"])
                    if started is not None:
                        started.set()
                if chunk.get("usage"):
                    outcome.num_tokens = chunk["usage"]["completion_tokens"]
            outcome.text = "".join(pieces)
            return outcome
    except httpx.HTTPError:
        outcome.error = "disconnected"
        return outcome
    finally:
        outcome.answered_s = time.monotonic()


def _until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


async def _until_async(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    requests: list[asyncio.Task[Outcome]] = (),  # type: ignore[assignment]
) -> None:
    """Until predicate() holds; fails after timeout_s, or at once if one of `requests`
    ended meanwhile (refused, say), with its outcome."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        ended = [r.result() for r in requests if r.done()]
        assert not ended, f"requests ended while waiting for {what}: {ended}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _drained(fleet: Fleet, tenant_id: str, timeout_s: float = 60.0) -> dict[str, dict]:
    """The tenant's jobs once none is queued or running any more."""

    def ended() -> dict[str, dict] | None:
        jobs = fleet.jobs(tenant_id)
        return None if any(j.get("st") in ("queued", "leased") for j in jobs.values()) else jobs

    return _until(ended, timeout_s, "the tenant's jobs to end")


def _live_workers(fleet: Fleet) -> int:
    return fleet.queues()["workers"]["live"]


# --------------------------------------------------------------------------- tests
async def _stall_redis(
    fleet: Fleet, key: str, num_requests: int, max_tokens: int, pause_s: float
) -> tuple[list[Outcome], int]:
    """Requests spread over both gateways; Redis stands still for `pause_s` once
    MAX_NUM_SEQS of them stream. Returns the outcomes, and when Redis was back (its
    clock, ms)."""
    # Right after a stall the workers' reports are stale until their next heartbeat, and
    # admission refuses new requests (no_capacity) meanwhile.
    _until(lambda: _live_workers(fleet) == 2, 15, "both workers to report")
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        started = [asyncio.Event() for _ in range(num_requests)]
        requests = [
            asyncio.create_task(
                _request(http, fleet.gateways[i % 2], key, max_tokens, started=started[i])
            )
            for i in range(num_requests)
        ]
        await _until_async(
            lambda: sum(e.is_set() for e in started) >= MAX_NUM_SEQS,
            60,
            "requests to stream",
            requests,
        )
        fleet.redis.pause()
        try:
            await asyncio.sleep(pause_s)
        finally:
            fleet.redis.resume()
        resumed_ms = fleet.now_ms()
        return list(await asyncio.gather(*requests)), resumed_ms


def test_a_stalled_redis_spares_waiting_clients_and_cancels_answered_ones(fleet: Fleet) -> None:
    tenant_id, key = fleet.tenant()
    abandoned_before = fleet.queues()["totals"]["abandoned_jobs"]
    # A short stall: every presence lapses, and is back within the queue's grace.
    outcomes, _ = asyncio.run(_stall_redis(fleet, key, 2 * MAX_NUM_SEQS, 600, SHORT_REDIS_PAUSE_S))
    assert [(o.error, o.num_tokens) for o in outcomes] == [(None, 600)] * len(outcomes)
    assert fleet.queues()["totals"]["abandoned_jobs"] == abandoned_before
    _drained(fleet, tenant_id)
    # A long one: half of the requests run, half wait in the queue.
    num_requests = 4 * MAX_NUM_SEQS
    outcomes, resumed_ms = asyncio.run(
        _stall_redis(fleet, key, num_requests, LONG, LONG_REDIS_PAUSE_S)
    )
    jobs = _drained(fleet, tenant_id)
    errored = [o for o in outcomes if o.error is not None]
    served = [o for o in outcomes if o.error is None]
    late_ms = {
        o.request_id: (last - resumed_ms)
        for o in errored
        if (last := fleet.last_token_ms(o.request_id)) is not None
    }
    print(
        f"errors {sorted((o.status, o.error) for o in errored)}; {len(served)} served; "
        f"errored jobs: {sorted((jobs.get(o.request_id) or {}).get('st', '-') for o in errored)}"
        f", their last tokens (ms after Redis was back): {sorted(late_ms.values())}"
    )
    assert errored, "no client got an error: pause Redis longer"
    assert all(o.error == "queue_unavailable" for o in errored), errored
    for outcome in errored:
        # Answered with an error: its job was cancelled (or never queued), and streamed
        # nothing after what was in flight when Redis came back.
        assert outcome.request_id
        record = jobs.get(outcome.request_id)
        assert record is None or record["st"] in ("cancelled", "done"), record
        assert late_ms.get(outcome.request_id, 0) <= AFTER_RESUME_MS, late_ms
    # The others (if any) were not hurt.
    assert all(o.num_tokens == LONG for o in served), served
    assert fleet.queues()["totals"]["abandoned_jobs"] == abandoned_before


def test_the_jobs_of_a_killed_gateway_stop_within_seconds(fleet: Fleet) -> None:
    """Kills the second gateway: the tests after this one use the first."""
    tenant_id, key = fleet.tenant()
    batch_tenant_id, batch_key = fleet.tenant("batch")
    victim, url = fleet.gateway_procs[1], fleet.gateways[1]
    # A fifth run at the kill, the rest wait in the queue. Until the gateway counts as
    # gone (its presence lapses, then a grace: about 7 s), the workers take queued jobs
    # as slots free: on a fast machine two more rounds finish in that time.
    num_requests = 10 * MAX_NUM_SEQS

    async def scenario() -> tuple[int, str]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            started = [asyncio.Event() for _ in range(num_requests)]
            requests = [
                asyncio.create_task(_request(http, url, key, LONG, started=started[i]))
                for i in range(num_requests)
            ]
            await _until_async(
                lambda: sum(e.is_set() for e in started) >= 2 * MAX_NUM_SEQS,
                60,
                "both workers to stream",
                requests,
            )
            # A batch the victim drives, its lines queued behind the streams (worse rank).
            [victim_gw] = {j["gw"] for j in fleet.jobs(tenant_id).values()}
            batch_id = await asyncio.to_thread(_batch_driven_by, fleet, url, batch_key, victim.pid)
            await _until_async(
                lambda: (
                    sum(j["gw"] == victim_gw for j in fleet.jobs(batch_tenant_id).values())
                    >= MAX_NUM_SEQS
                ),
                30,
                "the batch's lines to be queued",
                requests,
            )
            victim.kill()  # SIGKILL: no drain, no cancel
            victim.wait()
            killed_ms = fleet.now_ms()
            outcomes = await asyncio.gather(*requests)
            assert {o.error for o in outcomes} == {"disconnected"}
            return killed_ms, batch_id

    killed_ms, batch_id = asyncio.run(scenario())
    jobs = _drained(fleet, tenant_id)
    stopped_ms = fleet.now_ms() - killed_ms
    assert len(jobs) == num_requests
    states = sorted(j["st"] for j in jobs.values())
    last_ms = max(fleet.last_token_ms(job_id) or 0 for job_id in jobs) - killed_ms
    print(
        f"the dead gateway's streams all ended {stopped_ms} ms after the kill, their last "
        f"tokens {last_ms} ms after it: {states}"
    )
    assert last_ms <= GATEWAY_DEATH_BOUND_MS
    # The rest, still queued when the gateway counted as gone, never ran for nobody.
    assert set(states) <= {"done", "cancelled"}
    assert states.count("cancelled") >= num_requests // 2
    # The other gateway takes the batch over and runs each line once more; the victim's
    # jobs for them are abandoned rather than run for nobody.
    survivor = openai.OpenAI(
        base_url=f"{fleet.gateways[0]}/v1", api_key=batch_key, max_retries=0, timeout=60
    )
    batch = _until(
        lambda: (b := survivor.batches.retrieve(batch_id)).status in TERMINAL and b,
        120,
        "the batch to end",
    )
    assert (batch.status, batch.request_counts.completed) == ("completed", NUM_BATCH_LINES)
    results = [
        json.loads(line)
        for line in survivor.files.content(batch.output_file_id).text.split("\n")
        if line
    ]
    assert sorted(r["custom_id"] for r in results) == sorted(
        f"row-{i}" for i in range(NUM_BATCH_LINES)
    )
    [victim_id] = {j["gw"] for j in jobs.values()}
    orphans = {i: j for i, j in fleet.jobs(batch_tenant_id).items() if j["gw"] == victim_id}
    orphans_last_ms = max(fleet.last_token_ms(job_id) or 0 for job_id in orphans) - killed_ms
    totals = fleet.queues()["totals"]
    scraped = _until(lambda: _scraped_abandoned(fleet, totals["abandoned_jobs"]), 5, "metrics")
    print(
        f"its batch lines: {sorted(j['st'] for j in orphans.values())}, their last tokens "
        f"{orphans_last_ms} ms after the kill; totals {totals}"
    )
    assert orphans
    assert all(j["st"] in ("cancelled", "done") for j in orphans.values())
    assert orphans_last_ms <= GATEWAY_DEATH_BOUND_MS
    assert totals["abandoned_jobs"] >= states.count("cancelled")
    assert scraped.startswith("tiergate_queue_abandoned_jobs_total ")
    # The survivor bills the victim's requests that left the queue, for what their
    # streams hold, once the victim has been gone for the billing grace (15 s); those
    # that never left it cost nothing, and the abandoned batch lines are not billed (the
    # lines ran again).
    served = {i: j for i, j in jobs.items() if int(j.get("att") or 0) > 0}
    assert len(served) >= 2 * MAX_NUM_SEQS
    billed = _until(
        lambda: len(u := fleet.usage(tenant_id)) >= len(served) and u,
        60,
        "the dead gateway's requests to be billed",
    )
    assert set(billed) == set(served)
    for job_id, (outcome, prompt, completion) in billed.items():
        assert completion == fleet.streamed_tokens(job_id)
        assert prompt == (int(served[job_id]["pin"]) if completion else 0)
        assert outcome == ("ok" if served[job_id]["st"] == "done" else "aborted")
    print(f"billed for the dead gateway: {sorted(billed.values())}")


TERMINAL = {"completed", "failed", "expired", "cancelled"}


def _batch_driven_by(fleet: Fleet, url: str, key: str, pid: int, attempts: int = 5) -> str:
    """A batch submitted through `url` whose driver is the gateway of `pid`. Any gateway's
    driver may claim a new batch (the one that took it is only woken first), so one
    another gateway took is cancelled and the batch submitted again."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    for _ in range(attempts):
        batch_id = _submit_batch(url, key)
        owner = _until(lambda b=batch_id: fleet.batch_owner(b), 30, "the batch to be claimed")
        if int(owner.split(":")[1]) == pid:
            return batch_id
        client.batches.cancel(batch_id)
        _until(
            lambda b=batch_id: client.batches.retrieve(b).status in TERMINAL,
            60,
            "a batch another gateway claimed to be cancelled",
        )
    raise AssertionError(f"another gateway claimed each of {attempts} batches")


def _submit_batch(url: str, key: str) -> str:
    """A batch of NUM_BATCH_LINES short completions, created through `url`."""
    lines = [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 64, "temperature": 0},
        }
        for i in range(NUM_BATCH_LINES)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    uploaded = client.files.create(file=("rows.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    ).id


def _scraped_abandoned(fleet: Fleet, expected: int) -> str | None:
    """The abandoned-jobs line of a gateway's /metrics, once it counts `expected`."""
    metrics = httpx.get(f"{fleet.gateways[0]}/metrics", timeout=10).text
    for line in metrics.splitlines():
        if line.startswith("tiergate_queue_abandoned_jobs") and float(line.split()[-1]) == expected:
            return line
    return None


def test_a_request_whose_worker_died_is_answered_within_a_bound(fleet: Fleet) -> None:
    """Last in the module: it kills both workers. First w2 is paused (out of the fleet)
    and w1 SIGKILLed mid-stream: the gateway sees no live worker, w2 resumes within the
    grace, reclaims the job and finishes it. Then w2, the only worker, is SIGKILLed with
    two requests running: both are answered 503 no_capacity within the bound."""
    tenant_id, key = fleet.tenant()
    gateway = fleet.gateways[0]
    max_tokens = 400

    async def reference() -> Outcome:
        async with httpx.AsyncClient(timeout=120) as http:
            return await _request(http, gateway, key, max_tokens)

    expected = asyncio.run(reference())
    assert expected.num_tokens == max_tokens, expected  # eos really is biased away
    fleet.workers["w2"].send_signal(signal.SIGSTOP)
    try:
        _until(lambda: _live_workers(fleet) == 1, 15, "w2's report to lapse")

        async def comeback() -> tuple[Outcome, float]:
            async with httpx.AsyncClient(timeout=120) as http:
                started = asyncio.Event()
                request = asyncio.create_task(
                    _request(http, gateway, key, max_tokens, started=started)
                )
                await asyncio.wait_for(started.wait(), 60)
                fleet.workers["w1"].kill()
                fleet.workers["w1"].wait()
                killed_s = time.monotonic()
                await _until_async(lambda: _live_workers(fleet) == 0, 15, "w1's report to lapse")
                await asyncio.sleep(1.0)
                fleet.workers["w2"].send_signal(signal.SIGCONT)
                return await request, killed_s

        resumed, killed_s = asyncio.run(comeback())
    finally:
        fleet.workers["w2"].send_signal(signal.SIGCONT)
    print(f"served {resumed.answered_s - killed_s:.1f} s after its worker was killed")
    assert resumed.error is None, resumed
    assert (resumed.num_tokens, resumed.text) == (expected.num_tokens, expected.text)
    _drained(fleet, tenant_id)

    async def nobody_left() -> tuple[list[Outcome], float]:
        async with httpx.AsyncClient(timeout=2 * NO_WORKER_BOUND_S + 10) as http:
            started = asyncio.Event()
            streamed = asyncio.create_task(_request(http, gateway, key, LONG, started=started))
            whole = asyncio.create_task(_request(http, gateway, key, LONG, stream=False))
            await asyncio.wait_for(started.wait(), 60)
            await _until_async(
                lambda: sum(j.get("st") == "leased" for j in fleet.jobs(tenant_id).values()) == 2,
                30,
                "both requests to run",
            )
            fleet.workers["w2"].kill()
            fleet.workers["w2"].wait()
            killed_s = time.monotonic()
            return list(await asyncio.gather(streamed, whole)), killed_s

    outcomes, killed_s = asyncio.run(nobody_left())
    took_s = [round(o.answered_s - killed_s, 1) for o in outcomes]
    print(f"answered {took_s} s after the only worker was killed")
    streamed, whole = outcomes
    # Headers were sent with the first token: the error comes as the stream's last event.
    assert (streamed.status, streamed.error) == (200, "no_capacity"), streamed
    assert (whole.status, whole.error) == (503, "no_capacity"), whole
    assert max(took_s) <= NO_WORKER_BOUND_S
    jobs = _drained(fleet, tenant_id, timeout_s=10)
    assert sorted(j["st"] for j in jobs.values()) == ["cancelled", "cancelled", "done", "done"]
