"""/admin/ui: the dashboard page, its static files, and the live JSON it polls.

The page and its scripts are public files with no data in them; every number comes from
`/admin/ui/api/live` and the admin API, both behind the admin bearer token, which the
page keeps in the tab's sessionStorage (given once through a login form or the
`#token=` URL fragment, which browsers never send to the server).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.deps import AdminDeps
from gateway.admin.routes import _guarded
from gateway.errors import NotFoundError
from gateway.observability import Telemetry

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"app.js": "text/javascript", "app.css": "text/css"}
# The page loads only its own files and talks only to its own origin.
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'"


def dashboard_routes(deps: AdminDeps, telemetry: Telemetry) -> list[BaseRoute]:
    """Routes to mount at /admin/ui."""

    async def page(_request: Request) -> Response:
        return FileResponse(
            STATIC_DIR / "index.html",
            media_type="text/html",
            headers={"content-security-policy": CSP, "cache-control": "no-cache"},
        )

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC_FILES:
            raise NotFoundError(f"Unknown file {name!r}.", code="unknown_url")
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])

    async def live(_request: Request) -> Response:
        return JSONResponse(telemetry.snapshot())

    return [
        Route("/", page, methods=["GET"]),
        # Errors escape to the gateway middleware, which answers in the one error shape.
        Route("/static/{name}", static, methods=["GET"]),
        Route("/api/live", _guarded(deps, live), methods=["GET"]),
    ]
