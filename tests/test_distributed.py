"""A fleet on one Redis: two `tiergate gateway` and two `tiergate worker` processes.

Real processes, a real PostgreSQL database and Redis (under a key prefix of this module),
the tiny-random model on the CPU. Checked here: weighted fair share between backlogged
tenants of one tier, a rank-0 tenant's TTFT under a batch flood, SLO admission with an
honest Retry-After, admin changes reaching the other gateway within a second, shared
rate limits through the openai client, and a worker SIGKILLed mid-stream losing nothing.
A one-process server on a Redis of its own shows an outage turning into quick 503s and
service resuming by itself once Redis is back.

The machine running this may have two cores shared by five processes, so every load
here is bounded: a fixed number of streams in flight per tenant (enough to keep the
queue backlogged, not more), one torch thread per worker, short requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import secrets
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from scheduler.keys import KeySpace
from scheduler.policy import PolicyConfig
from tests.conftest import REDIS_URL, _create_postgres_database, _drop_postgres_database
from tests.fleet_processes import (
    ONE_THREAD,
    delete_redis_prefix,
    fleet_env,
    free_port,
    spawn_tiergate,
    stop_processes,
    wait_ready,
)

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
PROMPT = "hello there"  # greedy tiny-random runs past 200 tokens on it without an eos
# One torch thread per process: two workers with a thread per core each would fight
# the gateways (and each other) for the same two cores.
# Short leases so that the SIGKILL test resumes a job within seconds; the worker's
# capacity report then lives max(5 heartbeats, 2 s) = 3.75 s.
LEASE_MS = 3000
MAX_NUM_SEQS = 4  # per worker: the queue, not the engines, holds the backlog


@dataclass
class Fleet:
    gateways: list[str]  # base URLs
    admin_token: str
    prefix: str
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # tenant name -> API key
    tenant_ids: dict[str, str] = field(default_factory=dict)

    def client(self, tenant: str, gateway: int = 0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.gateways[gateway]}/v1",
            api_key=self.keys[tenant],
            max_retries=0,
            timeout=60,
        )

    def admin(self, gateway: int = 0) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.gateways[gateway]}/admin/v1",
            headers={"authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )

    def add_tier(self, name: str, **fields: object) -> None:
        with self.admin() as admin:
            admin.post("/tiers", json={"name": name, **fields}).raise_for_status()

    def add_tenant(self, name: str, tier: str, **fields: object) -> None:
        with self.admin() as admin:
            tenant = admin.post("/tenants", json={"name": name, "tier": tier, **fields})
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
        self.keys[name] = key.json()["secret"]
        self.tenant_ids[name] = tenant.json()["id"]

    def queues(self) -> dict:
        with self.admin() as admin:
            reply = admin.get("/queues")
            reply.raise_for_status()
            return reply.json()

    def capacity(self) -> dict:
        """The fleet totals of /queues (without the per-worker list, whose ages move)."""
        workers = self.queues()["workers"]
        return {
            name: workers[name] for name in ("live", "prefill_tokens_per_s", "decode_tokens_per_s")
        }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    from gateway.migrate import upgrade_to_head

    database_url = _create_postgres_database()
    upgrade_to_head(database_url)
    logs = tmp_path_factory.mktemp("fleet")
    prefix = f"{{tgfleet-{uuid.uuid4().hex[:10]}}}:"
    admin_token = secrets.token_urlsafe(16)
    env = fleet_env(
        database_url=database_url,
        redis_url=REDIS_URL,
        prefix=prefix,
        admin_token=admin_token,
        data_dir=logs,
    )
    procs: list[subprocess.Popen] = []
    fleet = Fleet([], admin_token, prefix)
    try:
        for name in ("w1", "w2"):
            worker = spawn_tiergate(
                [
                    "worker",
                    "--device=cpu",
                    "--kv-cache-bytes=16777216",
                    f"--max-num-seqs={MAX_NUM_SEQS}",
                    f"--lease-ms={LEASE_MS}",
                    "--drain-timeout-s=5",
                    f"--worker-id={name}",
                ],
                env,
                logs / f"{name}.log",
            )
            fleet.workers[name] = worker
            procs.append(worker)
        for i in range(2):
            port = free_port()
            procs.append(
                spawn_tiergate(["gateway", f"--port={port}"], env, logs / f"gateway{i}.log")
            )
            fleet.gateways.append(f"http://127.0.0.1:{port}")
        for url in fleet.gateways:
            wait_ready(url, procs)
        yield fleet
    finally:
        stop_processes(procs)
        delete_redis_prefix(REDIS_URL, prefix)
        _drop_postgres_database(database_url)


# --------------------------------------------------------------------------- load
@dataclass(frozen=True)
class Served:
    """One streamed completion as its client saw it (monotonic seconds)."""

    tenant: str
    sent_s: float
    first_s: float  # first token
    last_s: float  # last token
    num_prompt_tokens: int
    num_completion_tokens: int

    @property
    def ttft_ms(self) -> float:
        return (self.first_s - self.sent_s) * 1000.0

    def weighted_tokens_between(self, start_s: float, end_s: float, config: PolicyConfig) -> float:
        """The fair-share charge of this request (the policy's input and output token
        weights) that fell in [start_s, end_s): the prompt when its first token came,
        the output spread evenly from the first token to the last."""
        total = 0.0
        if start_s <= self.first_s < end_s:
            total += config.input_token_weight * self.num_prompt_tokens
        output = config.output_token_weight * self.num_completion_tokens
        if self.last_s <= self.first_s:
            return total + (output if start_s <= self.first_s < end_s else 0.0)
        overlap_s = min(end_s, self.last_s) - max(start_s, self.first_s)
        return total + output * max(0.0, overlap_s) / (self.last_s - self.first_s)


async def _stream_one(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    tenant: str,
    max_tokens: int,
    prompt: object = PROMPT,
    started: asyncio.Event | None = None,
) -> Served:
    """One streamed completion, timed on arrival of its chunks; sets `started` at the
    first token."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent_s = time.monotonic()
    first_s = last_s = 0.0
    usage: dict = {}
    async with http.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        assert response.status_code == 200, (tenant, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("choices"):
                last_s = time.monotonic()
                first_s = first_s or last_s
                if started is not None:
                    started.set()
            if chunk.get("usage"):
                usage = chunk["usage"]
    return Served(
        tenant,
        sent_s,
        first_s,
        last_s,
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


# Two batch tenants, weights 1 and 3, each with FAIR_IN_FLIGHT streams open at all times
# (a new request as soon as one ends). The engines hold 2 x MAX_NUM_SEQS = 8 of them, a
# quarter for fair-a and three quarters for fair-b, and a few more are between a reply
# and the next request: these counts leave each tenant many queued jobs at all times,
# so the queue's policy alone decides who runs, and a newcomer queued behind the batch
# work would wait seconds. A queued request costs an open connection and nothing else.
FAIR_WEIGHTS = {"fair-a": 1.0, "fair-b": 3.0}
FAIR_IN_FLIGHT = {"fair-a": 20, "fair-b": 60}
FAIR_PROMPT = list(range(10, 26))  # 16 prompt tokens
FAIR_MAX_TOKENS = 32
WARMUP_S = 3.0  # both tenants' queues fill and the engines' batches settle
# The window holds at least this many of fair-a's requests (a slow machine takes
# longer, never measures less), and must close within MAX_WINDOW_S.
FAIR_MIN_REQUESTS = 30
MAX_WINDOW_S = 60.0
# Fair queuing keeps the backlogged tenants' virtual counters within about the cost of
# the jobs they have running, not level: a job is chosen on its prompt and its output is
# charged as it is generated. Opened and closed at arbitrary moments, a window of 30
# requests carries that gap (up to ~5% of it) into the ratio; the window therefore opens
# and closes at moments when the counters are level within LEVEL_COUNTER, so what it
# measures is the share the policy delivers. The share itself comes from the clients.
LEVEL_COUNTER = 4.0  # two output tokens of fair-a
PROBE_PERIOD_S = 0.5
# The rank-0 probe tier's TTFT SLO. On a two-core CPU shared by two gateways, two
# workers and the load generator (and whatever else runs there), a first token takes
# from a few hundred ms to over 2 s end to end even when the probe is served next: it
# crosses enqueue, a lease poll, the engine step in progress, a prefill, two Redis
# hops and two event loops that each serve dozens of streams. The seeded priority
# tier's 500 ms is a GPU figure. 4 s still fails when rank order is ignored: the probe
# then waits behind the batch backlog, which the test checks is deeper than that.
PROBE_TTFT_SLO_MS = 4000.0


def _weighted_tokens_per_request() -> float:
    config = PolicyConfig()
    return (
        config.input_token_weight * len(FAIR_PROMPT) + config.output_token_weight * FAIR_MAX_TOKENS
    )


@dataclass
class FloodResult:
    served: list[Served]
    probes: list[Served]
    depth: list[tuple[float, dict[str, int]]]  # (monotonic s, tenant name -> queued jobs)
    window_start_s: float
    window_end_s: float
    is_level: bool = False  # the window opened and closed at level counters

    def weighted_tokens(self, end_s: float | None = None) -> dict[str, float]:
        """Each tenant's fair-share charge served inside the window (or up to end_s)."""
        end_s = self.window_end_s if end_s is None else end_s
        config = PolicyConfig()
        tokens = {tenant: 0.0 for tenant in FAIR_WEIGHTS}
        for s in self.served:
            tokens[s.tenant] += s.weighted_tokens_between(self.window_start_s, end_s, config)
        return tokens


async def _flood(fleet: Fleet) -> FloodResult:
    started_s = time.monotonic()
    result = FloodResult([], [], [], started_s + WARMUP_S, started_s + WARMUP_S + MAX_WINDOW_S)
    names = {fleet.tenant_ids[t]: t for t in FAIR_WEIGHTS}
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    stop = asyncio.Event()

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def tenant_stream(tenant: str, slot: int) -> None:
            i = slot
            stopped = asyncio.create_task(stop.wait())
            while not stop.is_set():
                started = asyncio.Event()
                request = asyncio.create_task(
                    _stream_one(
                        http,
                        fleet.gateways[i % 2],
                        fleet.keys[tenant],
                        tenant,
                        FAIR_MAX_TOKENS,
                        FAIR_PROMPT,
                        started,
                    )
                )
                await asyncio.wait({request, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not request.done() and not started.is_set():
                    # Still queued when the window closed: nothing of it was served in
                    # the window, and draining the backlog would take as long as it is
                    # deep. Hanging up cancels it.
                    request.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await request
                    return
                result.served.append(await request)
                i += 1

        async def probe_loop() -> None:
            await asyncio.sleep(WARMUP_S)
            i = 0
            while not stop.is_set():
                result.probes.append(
                    await _stream_one(http, fleet.gateways[i % 2], fleet.keys["prio"], "prio", 4)
                )
                i += 1
                await asyncio.sleep(PROBE_PERIOD_S)

        async def depth_loop() -> None:
            headers = {"authorization": f"Bearer {fleet.admin_token}"}
            while not stop.is_set():
                reply = await http.get(f"{fleet.gateways[0]}/admin/v1/queues", headers=headers)
                reply.raise_for_status()
                tenants = reply.json()["tiers"].get("batch", {}).get("tenants", {})
                queued = {name: 0 for name in FAIR_WEIGHTS}
                for tenant_id, d in tenants.items():
                    if tenant_id in names:
                        queued[names[tenant_id]] = d["queued_jobs"]
                result.depth.append((time.monotonic(), queued))
                await asyncio.sleep(0.2)

        async def close_window() -> None:
            """Open the window at level counters after the warm-up; close it at level
            counters once fair-a has been served enough (or give up at the deadline)."""
            enough = FAIR_MIN_REQUESTS * _weighted_tokens_per_request()
            counters_key = KeySpace(fleet.prefix).counters("batch")
            a, b = (fleet.tenant_ids[t] for t in FAIR_WEIGHTS)
            store = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
            try:
                await asyncio.sleep(WARMUP_S)
                deadline_s = time.monotonic() + MAX_WINDOW_S
                is_open = False
                while time.monotonic() < deadline_s:
                    counters = await store.hgetall(counters_key)
                    now_s = time.monotonic()
                    if abs(float(counters[a]) - float(counters[b])) <= LEVEL_COUNTER:
                        if not is_open:
                            result.window_start_s, is_open = now_s, True
                        elif result.weighted_tokens(now_s)["fair-a"] >= enough:
                            result.window_end_s, result.is_level = now_s, True
                            return
                    await asyncio.sleep(0.02)
                result.window_end_s = time.monotonic()
            finally:
                stop.set()
                await store.aclose()

        await asyncio.gather(
            close_window(),
            probe_loop(),
            depth_loop(),
            *(
                tenant_stream(tenant, slot)
                for tenant, num_streams in FAIR_IN_FLIGHT.items()
                for slot in range(num_streams)
            ),
        )
    return result


@pytest.fixture(scope="module")
def flood(fleet: Fleet) -> FloodResult:
    for tenant, weight in FAIR_WEIGHTS.items():
        fleet.add_tenant(tenant, "batch", weight=weight, max_concurrency=100)
    fleet.add_tier("probe", rank=0, ttft_slo_ms=PROBE_TTFT_SLO_MS)
    fleet.add_tenant("prio", "probe")
    return asyncio.run(_flood(fleet))


def _assert_backlogged(result: FloodResult, start_s: float, end_s: float) -> None:
    samples = [q for t, q in result.depth if start_s <= t <= end_s]
    print("fewest queued jobs:", {t: min(q[t] for q in samples) for t in FAIR_WEIGHTS})
    # Sampled every 0.2 s, or as fast as a loaded gateway answers: no blind spot longer
    # than the time a tenant's queue of a dozen jobs takes to drain.
    times_s = [start_s] + [t for t, _ in result.depth if start_s <= t <= end_s] + [end_s]
    assert max(b - a for a, b in itertools.pairwise(times_s)) <= 3.0
    for queued in samples:
        assert min(queued.values()) >= 1, f"a tenant ran out of queued work: {queued}"


@pytest.mark.timing
def test_backlogged_tenants_share_by_weight(flood: FloodResult) -> None:
    start_s, end_s = flood.window_start_s, flood.window_end_s
    tokens = flood.weighted_tokens()
    ratio = tokens["fair-b"] / tokens["fair-a"]
    print(
        f"weighted tokens served over {end_s - start_s:.1f} s while both were backlogged: "
        f"{ {t: round(n) for t, n in tokens.items()} }, ratio {ratio:.3f} (target 3)"
    )
    # The measurement means something only while both tenants have queued work, and
    # with enough service in the window that one request more or less cannot decide it.
    _assert_backlogged(flood, start_s, end_s)
    assert flood.is_level, "the counters were never level again: the policy is not fair"
    assert tokens["fair-a"] >= FAIR_MIN_REQUESTS * _weighted_tokens_per_request()
    assert abs(ratio - 3.0) <= 0.05 * 3.0


@pytest.mark.timing
def test_rank_zero_ttft_meets_its_slo_under_a_batch_flood(flood: FloodResult) -> None:
    probes = flood.probes
    assert len(probes) >= 10
    # Batch work was queued the whole time the probes ran (else they proved nothing).
    _assert_backlogged(flood, probes[0].sent_s, probes[-1].first_s)
    ttfts_ms = sorted(p.ttft_ms for p in probes)
    batch_ttfts_ms = sorted(
        s.ttft_ms for s in flood.served if probes[0].sent_s <= s.sent_s <= probes[-1].sent_s
    )
    print(
        f"rank-0 TTFT ms under the flood: {[round(t) for t in ttfts_ms]}; batch TTFT "
        f"median {batch_ttfts_ms[len(batch_ttfts_ms) // 2]:.0f} ms"
    )
    # Served behind the batch backlog instead of ahead of it, a probe would miss its SLO.
    assert batch_ttfts_ms[len(batch_ttfts_ms) // 2] > PROBE_TTFT_SLO_MS
    assert ttfts_ms[-1] <= PROBE_TTFT_SLO_MS


# --------------------------------------------------------------------------- admission
def _completion(fleet: Fleet, tenant: str, gateway: int, **kwargs: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **kwargs}
    return httpx.post(
        f"{fleet.gateways[gateway]}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {fleet.keys[tenant]}"},
        timeout=60,
    )


def _until(predicate, timeout_s: float) -> float:
    """Seconds until predicate() held; fails after timeout_s."""
    started_s = time.monotonic()
    while not predicate():
        if time.monotonic() - started_s > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started_s


def test_admin_tier_change_reaches_the_other_gateway_within_a_second(fleet: Fleet) -> None:
    fleet.add_tier("tight", rank=1, ttft_slo_ms=0.001)
    fleet.add_tenant("tight-a", "tight")
    # A 1 us TTFT SLO cannot be met: the other gateway refuses once it knows the tier.
    replies: list[httpx.Response] = []
    _until(
        lambda: replies.append(_completion(fleet, "tight-a", 1)) or replies[-1].status_code != 404,
        1.0,
    )
    assert replies[-1].status_code == 429
    assert replies[-1].json()["error"]["code"] == "slo_unattainable"
    with fleet.admin() as admin:
        admin.patch("/tiers/tight", json={"ttft_slo_ms": 60_000.0}).raise_for_status()
    took_s = _until(lambda: _completion(fleet, "tight-a", 1).status_code == 200, 1.0)
    print(f"the other gateway applied the tier change after {took_s * 1000:.0f} ms")


SLO_PROMPT = list(range(10, 26))  # 16 prompt tokens
SLO_MAX_TOKENS = 200


def _workers(fleet: Fleet, signum: int) -> None:
    for worker in fleet.workers.values():
        if worker.poll() is None:
            worker.send_signal(signum)


@pytest.mark.timing
def test_slo_refusal_retry_after_is_honest(fleet: Fleet) -> None:
    """One job queued ahead makes a second one miss a tight SLO; its Retry-After is the
    model's wait, and honouring it (the job ahead has left the queue by then) succeeds."""
    from scheduler.admission import AdmissionConfig

    # Idle workers report the same measured rates until they step again, so the
    # prediction below is the one the gateway makes. A report may still lag the last
    # step by one heartbeat: read until two reads a heartbeat and more apart agree.
    _until(lambda: not fleet.queues()["tiers"], 10.0)
    reads = [fleet.capacity()]
    while len(reads) < 2 or reads[-1] != reads[-2]:
        time.sleep(LEASE_MS / 4 / 1000 + 0.2)
        reads.append(fleet.capacity())
        assert len(reads) < 10, reads
    capacity = reads[-1]
    assert capacity["live"] == 2
    prompt_ms = 1000.0 * len(SLO_PROMPT) / capacity["prefill_tokens_per_s"]
    decode_ms = (
        1000.0
        * AdmissionConfig().decode_ahead_fraction
        * SLO_MAX_TOKENS
        / capacity["decode_tokens_per_s"]
    )
    # The gateway's prediction for a job alone: what a 1 us SLO refuses it by.
    fleet.add_tier("slo", rank=1, ttft_slo_ms=0.001)
    fleet.add_tenant("slo-a", "slo")
    key = fleet.keys["slo-a"]
    url = fleet.gateways[0]  # the gateway the tier was changed on knows it at once
    alone = _completion(fleet, "slo-a", 0, prompt=SLO_PROMPT, max_tokens=SLO_MAX_TOKENS)
    assert alone.status_code == 429, alone.text
    alone_ms = int(alone.headers["retry-after-ms"])
    # Behind a job like it, one more prompt_ms + decode_ms. The SLO sits in between, so
    # the first is admitted and exactly the second one is refused.
    slo_ms = alone_ms + 0.1 * decode_ms
    with fleet.admin() as admin:
        admin.patch("/tiers/slo", json={"ttft_slo_ms": slo_ms}).raise_for_status()

    async def scenario() -> tuple[httpx.Response, float, Served, Served]:
        async with httpx.AsyncClient(timeout=120) as http:
            # Stopped workers lease nothing, so the job ahead stays queued; their
            # capacity reports outlive the few hundred ms this takes.
            _workers(fleet, signal.SIGSTOP)
            try:
                ahead = asyncio.create_task(
                    _stream_one(http, url, key, "slo-a", SLO_MAX_TOKENS, SLO_PROMPT)
                )
                await _until_queued(http, fleet, "slo")
                refused = await http.post(
                    f"{url}/v1/completions",
                    json={"model": MODEL, "prompt": SLO_PROMPT, "max_tokens": SLO_MAX_TOKENS},
                    headers={"authorization": f"Bearer {key}"},
                )
            finally:
                _workers(fleet, signal.SIGCONT)
            resumed_s = time.monotonic()
            assert refused.status_code == 429, refused.text
            # Honour the header, counted from when the fleet could work again.
            await asyncio.sleep(int(refused.headers["retry-after-ms"]) / 1000.0)
            again = await _stream_one(http, url, key, "slo-a", SLO_MAX_TOKENS, SLO_PROMPT)
            return refused, resumed_s, await ahead, again

    refused, _, ahead, again = asyncio.run(scenario())
    error = refused.json()["error"]
    assert error["code"] == "slo_unattainable", error
    wait_ms = int(refused.headers["retry-after-ms"])
    assert int(refused.headers["retry-after"]) == math.ceil(wait_ms / 1000)
    expected_ms = alone_ms + prompt_ms + decode_ms - slo_ms
    print(f"SLO {slo_ms:.0f} ms, Retry-After {wait_ms} ms (model: {expected_ms:.1f} ms)")
    # The job ahead's own share of the wait, no more (ceil to ms on both predictions).
    assert expected_ms - 2.0 <= wait_ms <= expected_ms + 2.0
    assert ahead.num_completion_tokens == again.num_completion_tokens == SLO_MAX_TOKENS


async def _until_queued(http: httpx.AsyncClient, fleet: Fleet, tier: str) -> None:
    """Return once the tier has a queued job (fails after 10 s)."""
    deadline_s = time.monotonic() + 10.0
    headers = {"authorization": f"Bearer {fleet.admin_token}"}
    while time.monotonic() < deadline_s:
        reply = await http.get(f"{fleet.gateways[0]}/admin/v1/queues", headers=headers)
        reply.raise_for_status()
        if tier in reply.json()["tiers"]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"nothing was queued in {tier!r}")


def test_rate_limits_are_shared_by_the_gateways(fleet: Fleet) -> None:
    fleet.add_tenant("limited", "interactive", rpm=2)
    first = fleet.client("limited", 0).completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2
    )
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    second = fleet.client("limited", 1).completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2
    )
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as refused:
        fleet.client("limited", 0).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    headers = refused.value.response.headers
    assert refused.value.code == "rate_limit_exceeded"
    wait_ms = int(headers["retry-after-ms"])
    assert 0 < wait_ms <= 30_000  # 2 per minute: a request every 30 s
    assert int(headers["retry-after"]) == math.ceil(wait_ms / 1000)
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_queues_list_each_worker_of_the_fleet(fleet: Fleet) -> None:
    # Either gateway shows every worker of the fleet, from the reports in Redis.
    for gateway in range(2):
        with fleet.admin(gateway) as admin:
            workers = admin.get("/queues").json()["workers"]
        listed = workers["data"]
        assert [w["id"] for w in listed] == sorted(fleet.workers)
        assert workers["live"] == len(listed)
        assert sum(w["prefill_tokens_per_s"] for w in listed) == workers["prefill_tokens_per_s"]
        for worker in listed:
            # Reported every heartbeat (LEASE_MS / 4); older reports would have lapsed.
            assert 0 <= worker["heartbeat_age_ms"] < max(5 * LEASE_MS / 4, 2000)
            assert worker["decode_tokens_per_s"] > 0
            assert 0.0 <= worker["kv_cache_usage"] <= 1.0
            assert worker["num_running"] <= MAX_NUM_SEQS
            assert worker["num_waiting"] >= 0


# --------------------------------------------------------------------------- failures
def test_sigkill_of_a_worker_mid_stream_loses_nothing(fleet: Fleet) -> None:
    fleet.add_tenant("ref", "interactive")
    reference = fleet.client("ref", 0).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=150, temperature=0
    )
    raw = fleet.client("ref", 1).completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=150,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    job_key = f"{fleet.prefix}job:{raw.headers['x-request-id']}"
    pieces: list[str] = []
    usage = None
    killed = None
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        for chunk in raw.parse():
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
            if killed is None and len(pieces) == 10:
                killed = store.hget(job_key, "wk")
                fleet.workers[killed].kill()  # SIGKILL: no drain, no requeue
                fleet.workers[killed].wait()
    finally:
        store.close()
    assert killed in fleet.workers
    assert "".join(pieces) == reference.choices[0].text  # no duplicate, no gap
    assert usage is not None
    assert usage.completion_tokens == reference.usage.completion_tokens


# --------------------------------------------------------------------------- Redis outage
class RedisServer:
    """A redis-server of this test's own on a free port (never the shared one)."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "no", "--daemonize", "no"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        client = redis.Redis.from_url(self.url)
        try:
            _until(lambda: _pings(client), 10.0)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture
def lone_server(tmp_path) -> Iterator[tuple[str, str, RedisServer]]:
    """`tiergate serve` (one process, SQLite) on a Redis of its own:
    (base URL, API key, the Redis server)."""
    store = RedisServer(tmp_path / "redis.log")
    store.start()
    port = free_port()
    admin_token = secrets.token_urlsafe(16)
    env = {
        **os.environ,
        **ONE_THREAD,
        "TIERGATE_REDIS_URL": store.url,
        "TIERGATE_ADMIN_TOKEN": admin_token,
        "TIERGATE_MODEL": MODEL,
        "TIERGATE_DEVICE": "cpu",
        "TIERGATE_MAX_MODEL_LEN": "256",
        "TIERGATE_KV_CACHE_BYTES": str(16 * 2**20),
        "TIERGATE_DATA_DIR": str(tmp_path / "data"),
    }
    env.pop("TIERGATE_DATABASE_URL", None)
    server = spawn_tiergate(["serve", f"--port={port}"], env, tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [server])
        with httpx.Client(
            base_url=f"{url}/admin/v1", headers={"authorization": f"Bearer {admin_token}"}
        ) as admin:
            tenant = admin.post("/tenants", json={"name": "outage", "tier": "interactive"})
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
        yield url, key.json()["secret"], store
    finally:
        stop_processes([server])
        store.stop()


def test_redis_outage_is_a_quick_503_and_service_resumes_by_itself(lone_server) -> None:
    url, key, store = lone_server

    def complete() -> httpx.Response:
        return httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )

    assert complete().status_code == 200
    store.stop()
    started_s = time.monotonic()
    down = complete()
    took_ms = (time.monotonic() - started_s) * 1000.0
    assert down.status_code == 503, down.text
    error = down.json()["error"]
    assert error["code"] == "queue_unavailable"
    assert "queue" in error["message"]
    assert "retry" in error["message"].lower()
    print(f"503 after {took_ms:.0f} ms with Redis down: {error['message']}")
    # Refused at once (a closed port refuses the connection), not after a timeout: the
    # bound leaves room for a starved CPU, not for the 10 s reply timeout.
    assert took_ms < 3000.0
    store.start()  # empty: the queue's tier table and the worker's report are gone
    replies: list[int] = []
    took_s = _until(lambda: replies.append(complete().status_code) or replies[-1] == 200, 15.0)
    assert set(replies) <= {200, 503}, replies
    print(f"served again {took_s * 1000:.0f} ms after Redis came back; replies {replies}")
