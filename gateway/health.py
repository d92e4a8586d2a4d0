"""/healthz (the process is up) and /readyz (it can serve: database, queue, a worker)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

# A named readiness check: returns normally when ready, raises when not.
ReadinessCheck = tuple[str, Callable[[], Awaitable[None]]]


def health_routes(checks: list[ReadinessCheck]) -> list[BaseRoute]:
    """Routes for /healthz and /readyz; /readyz runs every check and reports each."""

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_request: Request) -> Response:
        results: dict[str, str] = {}
        for name, check in checks:
            try:
                await check()
            except Exception as exc:
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
