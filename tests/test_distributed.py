"""A fleet on one Redis: two `tiergate gateway` and two `tiergate worker` processes.

Real processes, a real PostgreSQL database and Redis (under a key prefix of this module),
the tiny-random model on the CPU. Checked here: weighted fair share between backlogged
tenants of one tier, a priority tenant's TTFT under a batch flood, SLO admission with an
honest Retry-After, admin changes reaching the other gateway within a second, shared
rate limits through the openai client, and a worker SIGKILLed mid-stream losing nothing.
A separate one-process server shows a Redis outage turning into 503s and recovering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.conftest import REDIS_URL, _create_postgres_database, _drop_postgres_database

pytestmark = pytest.mark.slow

MODEL = "tiny-random"
PROMPT = "hello there"  # greedy tiny-random runs past 200 tokens on it without an eos
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    def add_tenant(self, name: str, tier: str, **fields: object) -> None:
        with self.admin() as admin:
            tenant = admin.post("/tenants", json={"name": name, "tier": tier, **fields})
            tenant.raise_for_status()
            key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
            key.raise_for_status()
        self.keys[name] = key.json()["secret"]
        self.tenant_ids[name] = tenant.json()["id"]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a fleet process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not become ready")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    from gateway.migrate import upgrade_to_head

    database_url = _create_postgres_database()
    upgrade_to_head(database_url)
    logs = tmp_path_factory.mktemp("fleet")
    prefix = f"{{tgfleet-{uuid.uuid4().hex[:10]}}}:"
    admin_token = secrets.token_urlsafe(16)
    env = {
        **os.environ,
        "TIERGATE_DATABASE_URL": database_url,
        "TIERGATE_REDIS_URL": REDIS_URL,
        "TIERGATE_REDIS_PREFIX": prefix,
        "TIERGATE_ADMIN_TOKEN": admin_token,
        "TIERGATE_MODEL": MODEL,
        "TIERGATE_MAX_MODEL_LEN": "256",
        "TIERGATE_DATA_DIR": str(logs),
    }
    procs: list[subprocess.Popen] = []
    fleet = Fleet([], admin_token, prefix)
    try:
        for name in ("w1", "w2"):
            # Four sequences per worker: the queue, not the engines, holds the backlog.
            worker = _spawn(
                [
                    "worker",
                    "--device=cpu",
                    "--kv-cache-bytes=16777216",
                    "--max-num-seqs=4",
                    "--lease-ms=1500",
                    f"--worker-id={name}",
                ],
                env,
                logs / f"{name}.log",
            )
            fleet.workers[name] = worker
            procs.append(worker)
        for i in range(2):
            port = _free_port()
            procs.append(_spawn(["gateway", f"--port={port}"], env, logs / f"gateway{i}.log"))
            fleet.gateways.append(f"http://127.0.0.1:{port}")
        for url in fleet.gateways:
            _wait_ready(url, procs)
        fleet.add_tenant("fair-a", "batch", weight=1.0, max_concurrency=500)
        fleet.add_tenant("fair-b", "batch", weight=3.0, max_concurrency=500)
        fleet.add_tenant("prio", "priority")
        fleet.add_tenant("ref", "interactive")
        fleet.add_tenant("limited", "interactive", rpm=2)
        yield fleet
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        client = redis.Redis.from_url(REDIS_URL)
        try:
            escaped = prefix.replace("{", "\\{").replace("}", "\\}")
            names = list(client.scan_iter(match=escaped + "*", count=1000))
            if names:
                client.delete(*names)
        finally:
            client.close()
        _drop_postgres_database(database_url)


# --------------------------------------------------------------------------- load
@dataclass
class Served:
    tenant: str
    first_token_s: float  # monotonic
    num_tokens: int  # prompt + completion


async def _stream_one(
    http: httpx.AsyncClient, url: str, key: str, max_tokens: int, prompt: object = PROMPT
) -> tuple[float, float, int]:
    """One streamed completion: (sent at, first token at, prompt + completion tokens)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent_s = time.monotonic()
    first_s = 0.0
    num_tokens = 0
    async with http.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and not first_s:
                first_s = time.monotonic()
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["total_tokens"]
    return sent_s, first_s, num_tokens


# Requests per batch tenant, all sent at once: in proportion to the weights, so that
# both stay backlogged for most of the run.
FLOOD_REQUESTS = {"fair-a": 60, "fair-b": 180}
# Prompt-heavy flood requests: their prompt is charged when they are dispatched, so the
# counters lag the service by little (outputs are charged as they are generated).
FLOOD_PROMPT = list(range(10, 50))
FLOOD_MAX_TOKENS = 4


async def _flood(fleet: Fleet) -> tuple[list[Served], list[float]]:
    """Two batch tenants (weights 1 and 3) send FLOOD_REQUESTS at once through both
    gateways while a priority tenant sends one request every 0.4 s; returns what the
    batch tenants were served and the priority TTFTs."""
    served: list[Served] = []
    ttfts_ms: list[float] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    is_flooding = True

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def batch_one(tenant: str, i: int) -> None:
            url = fleet.gateways[i % 2]
            _, first_s, num_tokens = await _stream_one(
                http, url, fleet.keys[tenant], FLOOD_MAX_TOKENS, FLOOD_PROMPT
            )
            served.append(Served(tenant, first_s, num_tokens))

        async def priority_loop() -> None:
            await asyncio.sleep(3.0)  # once the flood is admitted and queued
            i = 0
            while is_flooding:
                sent_s, first_s, _ = await _stream_one(
                    http, fleet.gateways[i % 2], fleet.keys["prio"], 4
                )
                ttfts_ms.append((first_s - sent_s) * 1000.0)
                i += 1
                await asyncio.sleep(0.3)

        probe = asyncio.create_task(priority_loop())
        await asyncio.gather(
            *(
                batch_one(tenant, i)
                for tenant, num_requests in FLOOD_REQUESTS.items()
                for i in range(num_requests)
            )
        )
        is_flooding = False
        await probe
    return served, ttfts_ms


@pytest.fixture(scope="module")
def flood(fleet: Fleet) -> tuple[list[Served], list[float], float, float]:
    served, ttfts = asyncio.run(_flood(fleet))
    # Both tenants are backlogged from shortly after the start until the first of them
    # has had its last request dispatched.
    window_start_s = min(s.first_token_s for s in served) + 1.0
    window_end_s = min(
        max(s.first_token_s for s in served if s.tenant == tenant)
        for tenant in ("fair-a", "fair-b")
    )
    return served, ttfts, window_start_s, window_end_s


def test_backlogged_tenants_share_by_weight(flood) -> None:
    served, _, window_start_s, window_end_s = flood
    tokens = {"fair-a": 0, "fair-b": 0}
    for s in served:
        if window_start_s <= s.first_token_s < window_end_s:
            tokens[s.tenant] += s.num_tokens
    assert tokens["fair-a"] > 0
    ratio = tokens["fair-b"] / tokens["fair-a"]
    print(
        f"served tokens over {window_end_s - window_start_s:.1f} s: {tokens}, "
        f"ratio {ratio:.3f} (target 3)"
    )
    assert abs(ratio - 3.0) <= 0.05 * 3.0


def test_priority_ttft_meets_its_slo_under_a_batch_flood(flood) -> None:
    _, ttfts_ms, _, _ = flood
    assert len(ttfts_ms) >= 5
    print(f"priority TTFT ms: max {max(ttfts_ms):.0f}, all {[round(t) for t in ttfts_ms]}")
    assert max(ttfts_ms) <= 500.0  # the seeded priority tier's TTFT SLO


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
    with fleet.admin() as admin:
        admin.post(
            "/tiers", json={"name": "tight", "rank": 1, "ttft_slo_ms": 1.0}
        ).raise_for_status()
    fleet.add_tenant("tight-a", "tight")
    # A 1 ms TTFT SLO cannot be met: the other gateway refuses once it knows the tier.
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


def test_slo_refusal_retry_after_is_honest(fleet: Fleet) -> None:
    with fleet.admin() as admin:
        admin.post(
            "/tiers", json={"name": "slo", "rank": 1, "ttft_slo_ms": 400.0}
        ).raise_for_status()
    fleet.add_tenant("slo-a", "slo")
    long_prompt = list(range(10, 170))  # 160 prompt tokens

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        f"{fleet.gateways[i % 2]}/v1/completions",
                        json={"model": MODEL, "prompt": long_prompt, "max_tokens": 60},
                        headers={"authorization": f"Bearer {fleet.keys['slo-a']}"},
                    )
                    for i in range(48)
                )
            )

    responses = asyncio.run(burst())
    refusals = [r for r in responses if r.status_code == 429]
    assert refusals, "the burst never exceeded the SLO"
    assert all(r.json()["error"]["code"] == "slo_unattainable" for r in refusals)
    assert all(r.status_code in (200, 429) for r in responses)
    refusal = refusals[0]
    wait_ms = int(refusal.headers["retry-after-ms"])
    assert int(refusal.headers["retry-after"]) == math.ceil(wait_ms / 1000)
    # The burst has been served by now: honouring any refusal's wait succeeds.
    time.sleep(wait_ms / 1000.0)
    again = _completion(fleet, "slo-a", 0, prompt=long_prompt, max_tokens=60)
    assert again.status_code == 200, again.text


def test_rate_limits_are_shared_by_the_gateways(fleet: Fleet) -> None:
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


# --------------------------------------------------------------------------- failures
def test_sigkill_of_a_worker_mid_stream_loses_nothing(fleet: Fleet) -> None:
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
