"""/healthz (the process is up) and /readyz (it can serve: database, queue, a worker)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

# A named readiness check: returns normally when ready, raises when not.
ReadinessCheck = tuple[str, Callable[[], Awaitable[None]]]

# A dependency that hangs (Redis stopped, a database behind a dead link) would hold
# /readyz for its client's socket timeout, 10 s per check in a row, past any probe's own
# timeout; a check that has not answered by then counts as unavailable.
CHECK_TIMEOUT_S = 2.0
# Checks that outlived their probe run on to their own timeout; held here so that they
# are not collected while pending.
_stragglers: set[asyncio.Task[None]] = set()


def health_routes(checks: list[ReadinessCheck]) -> list[BaseRoute]:
    """Routes for /healthz and /readyz; /readyz runs every check and reports each."""

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_request: Request) -> Response:
        # At once, each against the same deadline; a late one is left to finish alone
        # (cancelling a Redis call midway may leave its connection unusable).
        tasks = {name: asyncio.ensure_future(check()) for name, check in checks}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=CHECK_TIMEOUT_S)
        results: dict[str, str] = {}
        for name, task in tasks.items():
            if not task.done():
                _stragglers.add(task)
                task.add_done_callback(_forget)
                results[name] = f"unavailable: no answer within {CHECK_TIMEOUT_S:g} s"
            elif task.exception() is not None:
                exc = task.exception()
                results[name] = f"unavailable: {type(exc).__name__}: {exc}"
            else:
                results[name] = "ok"
        ready = all(v == "ok" for v in results.values())
        return JSONResponse(
            {"status": "ok" if ready else "unavailable", "checks": results},
            status_code=200 if ready else 503,
        )

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]


def _forget(task: asyncio.Task[None]) -> None:
    _stragglers.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: a late failure is no one's to report
