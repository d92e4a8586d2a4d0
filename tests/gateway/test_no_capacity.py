"""A gateway whose fleet has no live worker answers 503 `no_capacity` at once, for every
tier (with a TTFT SLO or without one), instead of holding the request open until a
worker appears; a worker that joins makes the same request succeed. Real Redis, a
`tiergate gateway` app (no engine) and the openai client."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import REDIS_URL
from tests.fleet_processes import delete_redis_prefix
from tests.gateway.conftest import ServerThread, build_test_engine

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def fleet_without_workers(tmp_path_factory) -> Iterator[tuple[str, str, str, dict[str, str]]]:
    """(gateway URL, admin token, Redis prefix, API key per tier) of a gateway alone."""
    from gateway.app import build_app
    from gateway.settings import Settings

    prefix = f"{{tgnocap-{uuid.uuid4().hex[:10]}}}:"
    data_dir: Path = tmp_path_factory.mktemp("nocap-data")
    settings = Settings(
        data_dir=data_dir,
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        admin_token=secrets.token_urlsafe(24),
        model=MODEL,
        device="cpu",
    )
    thread = ServerThread(build_app(settings, with_engine=False))
    thread.start()
    url = f"http://127.0.0.1:{thread.port}"
    keys = {}
    try:
        headers = {"authorization": f"Bearer {settings.admin_token}"}
        with httpx.Client(base_url=f"{url}/admin/v1", headers=headers, timeout=30) as admin:
            for tier in ("interactive", "batch"):
                tenant = admin.post("/tenants", json={"name": f"nocap-{tier}", "tier": tier})
                tenant.raise_for_status()
                key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
                key.raise_for_status()
                keys[tier] = key.json()["secret"]
        yield url, settings.admin_token or "", prefix, keys
    finally:
        thread.stop()
        delete_redis_prefix(REDIS_URL, prefix)


@pytest.mark.parametrize("tier", ["interactive", "batch"])
def test_no_live_worker_is_a_quick_503_for_every_tier(fleet_without_workers, tier: str) -> None:
    url, _token, _prefix, keys = fleet_without_workers
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=keys[tier], max_retries=0, timeout=10)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert time.monotonic() - started < 5.0
    assert refused.value.status_code == 503
    assert refused.value.code == "no_capacity"
    assert "x-request-id" in refused.value.response.headers
    # The readiness probe agrees.
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 503


def test_a_worker_joining_makes_the_request_succeed(fleet_without_workers) -> None:
    url, _token, prefix, keys = fleet_without_workers
    asyncio.run(_serve_one_request_with_a_worker(url, prefix, keys["batch"]))


async def _serve_one_request_with_a_worker(url: str, prefix: str, key: str) -> None:
    from gateway.queue_setup import build_queue
    from scheduler.worker import run_worker

    queue = build_queue(REDIS_URL, prefix)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(queue.backend, build_test_engine(), stop))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    try:
        deadline_s = time.monotonic() + 60
        while True:  # until the worker's first capacity report is seen
            try:
                reply = await client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
                break
            except openai.InternalServerError as exc:
                if exc.code != "no_capacity":
                    raise
                assert not worker.done(), "the worker stopped"
                assert time.monotonic() < deadline_s, "the joining worker was never seen"
                await asyncio.sleep(0.1)
        assert reply.usage.completion_tokens == 4
    finally:
        await client.close()
        stop.set()
        await worker
        await queue.aclose()
