"""The "not now" answers of a live server through the openai client, with the queue held
still: a tier's queue cap (tiers.max_queued_jobs) gives 429 `queue_full`, and cap changes
made through the admin API apply to the running queue; a tenant's concurrency cap gives
429 `concurrency_limit_exceeded`; a job left queued past its tier's `max_queue_ms` gives
429 `queue_timeout` and is counted as a refusal. Each 429 carries the expected wait as
Retry-After. A request larger than the tenant's whole TPM limit is a 400: no wait helps.
On SQLite and PostgreSQL, each with the in-memory queue and with the Redis queue (its
Lua enqueue enforces the cap there).

The server's engine is paused (it takes no work, as a fleet whose workers are all busy),
so queued jobs stay queued until the test lets them run.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import REDIS_URL
from tests.fleet_processes import delete_redis_prefix
from tests.gateway.conftest import ServerThread, build_test_engine

CAP = 2
PROMPT = "hello there"


class PausableEngine:
    """The real engine, except that it takes no new request while paused, and sends no
    output while it holds them (the model runs: its outputs wait)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.is_paused = False
        self.holds_outputs = False

    def can_accept(self, rank: int | None = None) -> bool:
        return not self.is_paused and self._engine.can_accept(rank)

    async def generate_batches(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with contextlib.aclosing(self._engine.generate_batches(*args, **kwargs)) as batches:
            async for batch in batches:
                # Polled: the test sets it from its own event loop, in another thread.
                while self.holds_outputs:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
                yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class CapServer:
    def __init__(self, base_url: str, admin_token: str, engine: PausableEngine) -> None:
        self.base_url = base_url
        self.admin_token = admin_token
        self.engine = engine

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=f"{self.base_url}/admin/v1",
            headers={"authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )


@pytest.fixture(scope="module", params=["memory", "redis"])
def queue_kind(request: pytest.FixtureRequest) -> Iterator[tuple[str | None, str]]:
    """(Redis URL or None, key prefix) of the queue the server uses."""
    if request.param == "memory":
        yield None, "{tiergate}:"
        return
    prefix = f"{{tgcap-{uuid.uuid4().hex[:10]}}}:"
    yield REDIS_URL, prefix
    delete_redis_prefix(REDIS_URL, prefix)


@pytest.fixture(scope="module")
def cap_server(live_database_url: str, queue_kind, tmp_path_factory) -> Iterator[CapServer]:
    from gateway.app import build_app
    from gateway.migrate import upgrade_to_head
    from gateway.settings import Settings

    if not live_database_url.startswith("sqlite"):
        upgrade_to_head(live_database_url)
    redis_url, prefix = queue_kind
    data_dir: Path = tmp_path_factory.mktemp("cap-data")
    settings = Settings(
        data_dir=data_dir,
        database_url=live_database_url,
        redis_url=redis_url,
        redis_prefix=prefix,
        admin_token=secrets.token_urlsafe(24),
        model="tiny-random",
        device="cpu",
    )
    engine = PausableEngine(build_test_engine())
    thread = ServerThread(build_app(settings, engine=engine))
    thread.start()
    try:
        yield CapServer(f"http://127.0.0.1:{thread.port}", settings.admin_token or "", engine)
    finally:
        engine.is_paused = False
        thread.stop()


async def _queued(admin: httpx.AsyncClient, tier: str) -> int:
    reply = await admin.get("/queues")
    reply.raise_for_status()
    return reply.json()["tiers"].get(tier, {}).get("queued_jobs", 0)


async def _until_queued(admin: httpx.AsyncClient, tier: str, num_jobs: int) -> None:
    deadline_s = time.monotonic() + 10.0
    while await _queued(admin, tier) != num_jobs:
        assert time.monotonic() < deadline_s, f"{tier} never held {num_jobs} queued jobs"
        await asyncio.sleep(0.02)


async def _enqueue_once_allowed(
    client: openai.AsyncOpenAI, admin: httpx.AsyncClient, tier: str, num_jobs: int
) -> asyncio.Task:
    """Send requests until one is queued as job number `num_jobs` (a raised cap reaches the
    queue within a second of the admin change); return the task of the queued one."""
    deadline_s = time.monotonic() + 1.0
    while True:
        task = asyncio.create_task(_complete(client))
        while not task.done():
            if await _queued(admin, tier) >= num_jobs:
                return task
            await asyncio.sleep(0.02)
        with pytest.raises(openai.RateLimitError):
            await task  # refused at the old cap: the change has not arrived yet
        assert time.monotonic() < deadline_s, "the raised cap did not apply within 1 s"


async def _complete(client: openai.AsyncOpenAI) -> Any:
    return await client.completions.create(
        model="tiny-random", prompt=PROMPT, max_tokens=4, temperature=0
    )


async def _refused(client: openai.AsyncOpenAI) -> openai.RateLimitError:
    """The 429 of a request past the cap (fails fast, not forever, if it is queued)."""
    with pytest.raises(openai.RateLimitError) as refused:
        await asyncio.wait_for(_complete(client), timeout=10)
    return refused.value


@pytest.fixture
async def capped_tenant(cap_server: CapServer) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    """(client of a tenant, its tier): a fresh tier capped at CAP queued jobs."""
    tier = f"capped-{uuid.uuid4().hex[:6]}"
    async with cap_server.admin() as admin:
        created = await admin.post("/tiers", json={"name": tier, "rank": 1, "max_queued_jobs": CAP})
        assert created.status_code == 201, created.text
        assert created.json()["max_queued_jobs"] == CAP
        tenant = await admin.post("/tenants", json={"name": tier, "tier": tier})
        tenant.raise_for_status()
        key = await admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
    client = openai.AsyncOpenAI(
        base_url=f"{cap_server.base_url}/v1", api_key=key.json()["secret"], max_retries=0
    )
    try:
        yield client, tier
    finally:
        await client.close()


async def test_request_past_the_tier_cap_is_429_queue_full(
    cap_server: CapServer, capped_tenant: tuple[openai.AsyncOpenAI, str]
) -> None:
    client, tier = capped_tenant
    async with cap_server.admin() as admin:
        cap_server.engine.is_paused = True
        try:
            queued = [asyncio.create_task(_complete(client)) for _ in range(CAP)]
            await _until_queued(admin, tier, CAP)
            refused = await _refused(client)
            assert refused.status_code == 429
            assert refused.code == "queue_full"
            assert tier in refused.message
            _assert_retry_after(refused)
            assert await _queued(admin, tier) == CAP  # the refused one left no trace

            # A raised cap applies to the running queue: one more fits, then no more.
            raised = await admin.patch(f"/tiers/{tier}", json={"max_queued_jobs": CAP + 1})
            assert raised.status_code == 200, raised.text
            queued.append(await _enqueue_once_allowed(client, admin, tier, CAP + 1))
            assert (await _refused(client)).code == "queue_full"
        finally:
            cap_server.engine.is_paused = False
        # Nothing admitted was lost: every queued request runs once the engine takes work.
        for reply in await asyncio.gather(*queued):
            assert reply.usage.completion_tokens == 4
        assert await _queued(admin, tier) == 0


async def test_removing_the_cap_lets_the_queue_grow(
    cap_server: CapServer, capped_tenant: tuple[openai.AsyncOpenAI, str]
) -> None:
    client, tier = capped_tenant
    async with cap_server.admin() as admin:
        uncapped = await admin.patch(f"/tiers/{tier}", json={"max_queued_jobs": None})
        assert uncapped.json()["max_queued_jobs"] is None
        cap_server.engine.is_paused = True
        try:
            queued = [await _enqueue_once_allowed(client, admin, tier, 1)]
            queued += [asyncio.create_task(_complete(client)) for _ in range(3 * CAP)]
            await _until_queued(admin, tier, 3 * CAP + 1)
        finally:
            cap_server.engine.is_paused = False
        assert len(await asyncio.gather(*queued)) == 3 * CAP + 1


async def test_choices_past_the_cap_are_refused_whole(
    cap_server: CapServer, capped_tenant: tuple[openai.AsyncOpenAI, str]
) -> None:
    """n choices are n jobs: when the cap takes only some, none stays queued; more
    choices than the cap can ever hold are a 400, not a 429 no wait would cure."""
    client, tier = capped_tenant
    args = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 4}
    with pytest.raises(openai.BadRequestError) as too_many:
        await client.completions.create(**args, n=CAP + 1)
    assert too_many.value.param == "n"
    async with cap_server.admin() as admin:
        cap_server.engine.is_paused = True
        try:
            first = asyncio.create_task(client.completions.create(**args))
            await _until_queued(admin, tier, 1)
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(**args, n=CAP)  # one fits, one does not
            assert refused.value.code == "queue_full"
            await asyncio.sleep(0.2)
            await _until_queued(admin, tier, 1)  # the choice queued first left again
        finally:
            cap_server.engine.is_paused = False
        await first
        fits = await client.completions.create(**args, n=CAP)
        assert [c.index for c in fits.choices] == list(range(CAP))
        assert await _queued(admin, tier) == 0


def _assert_retry_after(refused: openai.RateLimitError) -> float:
    """The 429's wait: present in both headers, consistent, and plausible; in seconds."""
    headers = refused.response.headers
    wait_ms = int(headers["retry-after-ms"])
    assert 0 < wait_ms < 60_000
    assert int(headers["retry-after"]) == max(1, -(-wait_ms // 1000))
    return wait_ms / 1000.0


async def _tenant(cap_server: CapServer, tier: dict[str, Any], **limits: Any) -> openai.AsyncOpenAI:
    """A client of a new tenant on a new tier (`tier`'s fields) with `limits`."""
    async with cap_server.admin() as admin:
        created = await admin.post("/tiers", json={"rank": 1, **tier})
        assert created.status_code == 201, created.text
        tenant = await admin.post(
            "/tenants", json={"name": tier["name"], "tier": tier["name"], **limits}
        )
        tenant.raise_for_status()
        key = await admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
    return openai.AsyncOpenAI(
        base_url=f"{cap_server.base_url}/v1", api_key=key.json()["secret"], max_retries=0
    )


async def test_the_concurrency_cap_is_429_with_the_expected_wait(cap_server: CapServer) -> None:
    name = f"conc-{uuid.uuid4().hex[:6]}"
    client = await _tenant(cap_server, {"name": name}, max_concurrency=1)
    try:
        async with cap_server.admin() as admin:
            cap_server.engine.is_paused = True
            try:
                held = asyncio.create_task(_complete(client))
                await _until_queued(admin, name, 1)
                with pytest.raises(openai.RateLimitError) as refused:
                    await asyncio.wait_for(_complete(client), timeout=10)
                assert refused.value.code == "concurrency_limit_exceeded"
                _assert_retry_after(refused.value)
            finally:
                cap_server.engine.is_paused = False
            assert (await held).usage.completion_tokens == 4
        # The slot is free again once the held request has ended (released in the
        # background, so give it a moment).
        deadline_s = time.monotonic() + 5
        while True:
            try:
                await _complete(client)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline_s, "the concurrency slot was never freed"
                await asyncio.sleep(0.05)
    finally:
        await client.close()


async def test_a_request_larger_than_the_whole_tpm_limit_is_400(cap_server: CapServer) -> None:
    client = await _tenant(cap_server, {"name": f"tpm-{uuid.uuid4().hex[:6]}"}, tpm=100)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model="tiny-random", prompt=PROMPT, max_tokens=200, temperature=0
            )
        assert refused.value.code == "exceeds_token_limit"
        assert refused.value.body["param"] == "max_tokens"
        assert "retry-after" not in refused.value.response.headers
        assert (await _complete(client)).usage.completion_tokens == 4  # within the limit
    finally:
        await client.close()


async def test_a_queue_timeout_is_a_refusal_with_the_expected_wait(cap_server: CapServer) -> None:
    name = f"short-{uuid.uuid4().hex[:6]}"
    client = await _tenant(cap_server, {"name": name, "max_queue_ms": 200}, rpm=1000)
    try:
        cap_server.engine.is_paused = True
        try:
            with pytest.raises(openai.RateLimitError) as refused:
                await asyncio.wait_for(_complete(client), timeout=10)
        finally:
            cap_server.engine.is_paused = False
        assert refused.value.code == "queue_timeout"
        _assert_retry_after(refused.value)
        assert refused.value.response.headers["x-ratelimit-limit-requests"] == "1000"
        # Counted as a refusal in the usage report, and no tokens billed.
        line = await _usage_line(cap_server, name, "requests")
        assert line["refusals"] == 1
        assert (line["input_tokens"], line["output_tokens"]) == (0, 0)
    finally:
        await client.close()


async def test_a_request_given_up_while_queued_is_not_billed(cap_server: CapServer) -> None:
    """Its client left before it ran: no input tokens in the usage report, and its
    prompt goes back to the tenant's TPM."""
    name = f"gone-{uuid.uuid4().hex[:6]}"
    client = await _tenant(cap_server, {"name": name}, tpm=60)  # refills 1 token a second
    long_prompt = [42] * 40  # token ids: exactly 40 prompt tokens
    try:
        cap_server.engine.is_paused = True
        try:
            async with cap_server.admin() as admin:
                queued = asyncio.create_task(
                    client.completions.create(
                        model="tiny-random", prompt=long_prompt, max_tokens=10
                    )
                )
                await _until_queued(admin, name, 1)
                queued.cancel()  # the client hangs up while its request waits
                await _until_queued(admin, name, 0)
        finally:
            cap_server.engine.is_paused = False
        line = await _usage_line(cap_server, name, "aborted")
        assert (line["requests"], line["input_tokens"], line["output_tokens"]) == (1, 0, 0)
        # The whole reservation came back (a charged 40-token prompt would take 40 s).
        raw = await client.completions.with_raw_response.create(
            model="tiny-random", prompt="hi", max_tokens=4
        )
        reply = raw.parse()
        remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
        assert remaining >= 60 - (reply.usage.prompt_tokens + 4) - 1
    finally:
        await client.close()


async def _usage_line(cap_server: CapServer, tier: str, count: str) -> dict[str, Any]:
    """The usage report's one line for `tier`, once its `count` reads 1."""
    async with cap_server.admin() as admin:
        deadline_s = time.monotonic() + 10
        while True:
            report = await admin.get("/usage", params={"tier": tier})
            report.raise_for_status()
            lines = report.json()["data"]
            if lines and lines[0][count] == 1:
                (line,) = lines
                return line
            assert time.monotonic() < deadline_s, "the usage record never arrived"
            await asyncio.sleep(0.1)


async def test_a_prompt_read_before_its_client_left_is_billed(cap_server: CapServer) -> None:
    """Leased and prefilled, no token sent yet, when the client hangs up: its prompt was
    served (billed, kept in the TPM), unlike one still queued (see the test above)."""
    name = f"read-{uuid.uuid4().hex[:6]}"
    client = await _tenant(cap_server, {"name": name}, tpm=1000)
    engine = cap_server.engine
    engine.holds_outputs = True
    try:
        request = asyncio.create_task(
            client.completions.create(model="tiny-random", prompt=[42] * 40, max_tokens=10)
        )
        deadline_s = time.monotonic() + 10
        while not engine.stats().num_running:  # in the engine: leased, its prompt read
            assert time.monotonic() < deadline_s, "the request never reached the engine"
            await asyncio.sleep(0.01)
        request.cancel()  # the client hangs up before its first token
        line = await _usage_line(cap_server, name, "aborted")
    finally:
        engine.holds_outputs = False
        await client.close()
    assert (line["requests"], line["input_tokens"]) == (1, 40)
