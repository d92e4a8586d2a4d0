"""/readyz answers within its deadline even when a dependency hangs."""

from __future__ import annotations

import asyncio
import time

import httpx
from starlette.applications import Starlette

from gateway.health import CHECK_TIMEOUT_S, health_routes


async def test_a_hung_dependency_makes_readyz_unavailable_in_time() -> None:
    release = asyncio.Event()

    async def hangs() -> None:  # a Redis that stopped answering
        await release.wait()

    async def fails() -> None:
        raise ConnectionError("refused")

    async def fine() -> None:
        return None

    app = Starlette(routes=health_routes([("queue", hangs), ("db", fails), ("workers", fine)]))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        started = time.monotonic()
        response = await asyncio.wait_for(client.get("/readyz"), CHECK_TIMEOUT_S + 3.0)
        took_s = time.monotonic() - started
        release.set()
    assert response.status_code == 503
    assert took_s < CHECK_TIMEOUT_S + 1.0
    checks = response.json()["checks"]
    assert checks["queue"].startswith("unavailable: no answer within")
    assert checks["db"] == "unavailable: ConnectionError: refused"
    assert checks["workers"] == "ok"
