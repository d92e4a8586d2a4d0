"""The composition root: one function builds the whole process from Settings.

`build_app(settings)` returns a Starlette app whose lifespan builds, in order, the
database (upgraded first when it is the embedded SQLite file), the tier catalog, the key
authenticator, the usage writer, the engine, the local queue and the dispatcher, then
mounts the routes bound to them; shutdown stops them in reverse. Nothing lives in module
globals: two apps in one process share nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import text
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route, Router
from starlette.types import Receive, Scope, Send

from gateway.admin import AdminDeps, admin_routes
from gateway.admin.queues import QueueMonitor, queue_routes
from gateway.admin.ui import dashboard_routes
from gateway.admin.usage_routes import usage_routes
from gateway.admission import Admission
from gateway.batches.setup import start_batch_api, upload_limits
from gateway.config_sync import (
    CONFIG_VERSION_SUFFIX,
    ConfigSync,
    SyncedKeyAuthenticator,
    SyncedTierCatalog,
)
from gateway.db.session import create_db_engine, create_sessionmaker
from gateway.engine_setup import build_engine
from gateway.errors import (
    ErrorKind,
    GatewayError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    error_response,
    register_error,
)
from gateway.health import health_routes
from gateway.heap import prepare_heap_for_serving
from gateway.middleware import GatewayMiddleware
from gateway.migrate import upgrade_to_head
from gateway.observability import Telemetry, TelemetryConfig, TelemetryMiddleware, metrics_routes
from gateway.observability.probes import (
    keep_tiers_fresh,
    local_worker_probe,
    queue_depth_probe,
    stop_task,
)
from gateway.openai.routes import OpenAIDeps, OpenAIRoutes
from gateway.openai.tokenize import TokenizeRoutes
from gateway.queue_setup import RESULT_POLL_MS, build_queue
from gateway.settings import Settings
from gateway.usage import UsageWriter
from gateway.usage_recovery import UsageRecovery
from scheduler.backend import BackendUnavailableError
from scheduler.dispatcher import Dispatcher, DispatcherConfig, EngineLike
from scheduler.results import JobClient

log = logging.getLogger(__name__)


class MethodNotAllowedError(GatewayError):
    """The path exists but not for this HTTP method (405)."""


register_error(MethodNotAllowedError, ErrorKind(405, "invalid_request_error", "method_not_allowed"))


class _DeferredRoutes:
    """An ASGI app whose router is built by the lifespan, once the components exist."""

    def __init__(self) -> None:
        self.router: Router | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.router is None:
            raise ServiceUnavailableError("The server is starting.", code="starting")
        await self.router(scope, receive, send)


def build_app(
    settings: Settings,
    *,
    engine: EngineLike | None = None,
    telemetry_config: TelemetryConfig | None = None,
    with_engine: bool = True,
    prepare_heap: bool = False,
) -> Starlette:
    """The gateway app for `settings`.

    `engine` replaces the engine the settings describe: a harness (the benchmark) may
    pass one built around another model runner. The app starts and shuts it down.
    `telemetry_config` defaults to the standard OTEL_* variables. With
    `with_engine=False` (`tiergate gateway`) the process runs no engine: it loads only
    the tokenizer and leaves the queued work to `tiergate worker` processes.
    `prepare_heap` (the serving commands; not apps built by tests, many to a process)
    freezes what start-up built, once it is built, and raises the collector's young
    threshold (gateway.heap).
    """
    deferred = _DeferredRoutes()
    telemetry = Telemetry(telemetry_config or TelemetryConfig.from_env())

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(telemetry.shutdown)  # last out: flushes the final spans
            deferred.router = await _build_router(
                settings, engine, telemetry, stack, with_engine=with_engine
            )
            if prepare_heap:
                prepare_heap_for_serving()
            try:
                yield
            finally:
                deferred.router = None

    app = Starlette(
        routes=[Mount("/", app=deferred)],
        middleware=[
            Middleware(
                GatewayMiddleware,
                max_body_bytes=settings.max_body_bytes,
                upload_limits=upload_limits(settings),
            ),
            Middleware(TelemetryMiddleware, telemetry=telemetry),
        ],
        exception_handlers={HTTPException: _http_exception},
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # see _router
    return app


def _router(routes: list[BaseRoute]) -> Router:
    """A router that answers a path it does not know with 404, never a slash redirect:
    Starlette's default 307s `POST /v1/completions/` to `/v1/completions`, which most
    clients do not follow (or follow by posting the body again)."""
    return Router(routes=routes, redirect_slashes=False)


async def _build_router(
    settings: Settings,
    engine: EngineLike | None,
    telemetry: Telemetry,
    stack: contextlib.AsyncExitStack,
    *,
    with_engine: bool = True,
) -> Router:
    database_url = settings.db_url
    if settings.is_embedded_db:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(upgrade_to_head, database_url)
    db_engine = create_db_engine(database_url)
    stack.push_async_callback(db_engine.dispose)
    sessionmaker = create_sessionmaker(db_engine)
    queue = build_queue(settings.redis_url, settings.redis_prefix)
    stack.push_async_callback(queue.aclose)
    sync = ConfigSync(
        queue.backend, redis_client=queue.redis, version_key=queue.key(CONFIG_VERSION_SUFFIX)
    )
    tiers = SyncedTierCatalog(sessionmaker, on_change=sync.changed)
    auth = SyncedKeyAuthenticator(
        sessionmaker, tiers, cache_ttl_s=settings.auth_cache_ttl_s, on_change=sync.changed
    )
    sync.bind(tiers, auth)
    try:
        await sync.start()
    except BackendUnavailableError:
        log.warning("the queue is unreachable; tiers are pushed at the next admin change")
    stack.push_async_callback(sync.aclose)

    usage = UsageWriter(sessionmaker, flush_interval_s=settings.usage_flush_interval_s)
    await usage.start()
    telemetry.watch_usage(usage)
    stack.push_async_callback(usage.aclose)  # closed last: it flushes the final records

    dispatcher: Dispatcher | None = None
    model: Any
    if with_engine:
        if engine is None:
            engine = await asyncio.to_thread(build_engine, settings)
        await _maybe_await(engine.start())  # type: ignore[attr-defined]
        stack.push_async_callback(_shutdown_engine, engine)
        dispatcher = Dispatcher(
            queue.backend,
            engine,
            config=DispatcherConfig(slot_wait_quantile=settings.slot_wait_quantile),
        )
        await dispatcher.publish_capacity()
        dispatcher.start()
        # One process: a job left running at shutdown has no one to resume it for.
        stack.push_async_callback(dispatcher.aclose, 0.0)
        jobs = JobClient(queue.backend, poll_ms=RESULT_POLL_MS, on_enqueue=dispatcher.notify)
        model = engine
        telemetry.watch_workers(local_worker_probe(engine, dispatcher.worker_id))
    else:
        from gateway.model_info import load_model_card

        model = await asyncio.to_thread(load_model_card, settings.model, settings.max_model_len)
        jobs = JobClient(queue.backend, poll_ms=RESULT_POLL_MS)
    stack.push_async_callback(jobs.aclose)
    usage.on_written = jobs.settle
    usage.claimed_elsewhere = jobs.claimed_elsewhere
    if queue.is_shared:  # the gateways of a fleet bill for those of them that died
        recovery = UsageRecovery(
            queue.backend, jobs.gateway_id, usage, sessionmaker, model=model.model_name
        )
        recovery.start()
        stack.push_async_callback(recovery.aclose)
    admission = Admission(queue.limiter, jobs, on_unknown_tier=sync.push_tiers)
    stack.push_async_callback(admission.aclose)
    monitor = QueueMonitor(queue.backend)
    monitor.start()
    stack.push_async_callback(monitor.aclose)
    telemetry.watch_queue(queue_depth_probe(monitor))
    if dispatcher is None:  # the workers are other processes: show what they report
        telemetry.watch_workers(monitor.workers)
    tier_watch = asyncio.create_task(keep_tiers_fresh(telemetry, tiers.all), name="tier-slos")
    stack.push_async_callback(stop_task, tier_watch)

    async def database_ready() -> None:
        async with db_engine.connect() as connection:
            await connection.execute(text("SELECT 1"))

    async def worker_ready() -> None:
        if dispatcher is not None:
            if not dispatcher.is_running:
                raise ServiceUnavailableError("the dispatcher is not running")
            if not getattr(engine, "is_running", True):
                raise ServiceUnavailableError("the engine is not running")
            return
        capacity = await queue.backend.fleet_capacity()
        if capacity.num_workers < 1:
            raise ServiceUnavailableError("no live worker")

    async def queue_ready() -> None:
        # The in-memory queue lives in this process; Redis must answer, on redis-py's
        # connections and on the script channel every request's scripts take (each
        # opens its own: a password Redis refuses fails one and not the other).
        await queue.backend.get_tiers()
        if queue.channel is not None:
            await queue.channel.call("PING")

    routes = health_routes(
        [("database", database_ready), ("queue", queue_ready), ("worker", worker_ready)]
    )
    openai = OpenAIRoutes(
        OpenAIDeps(
            auth=auth,
            tiers=tiers,
            model=model,
            dispatcher=jobs,
            usage=usage,
            created_s=int(time.time()),
            telemetry=telemetry,
            admission=admission,
        )
    )
    routes += openai.routes()
    routes += TokenizeRoutes(openai).routes()
    routes += await start_batch_api(
        settings,
        sessionmaker=sessionmaker,
        auth=auth,
        tiers=tiers,
        openai=openai,
        dispatcher=jobs,
        stack=stack,
        restore_tiers=sync.push_tiers,
    )
    routes += metrics_routes(telemetry)
    if settings.admin_token:
        deps = AdminDeps(
            sessionmaker=sessionmaker,
            admin_token=settings.admin_token,
            tiers=tiers,
            auth=auth,
            queue=queue.backend,
        )
        # Mount(routes=...) would build a Router that redirects slashes: pass our own.
        admin_api = admin_routes(deps) + usage_routes(deps)
        admin_api += queue_routes(queue.backend, settings.admin_token)
        routes.append(Mount("/admin/v1", app=_router(admin_api)))
        routes.append(Mount("/admin/ui", app=_router(dashboard_routes(deps, telemetry))))
        # The documented address of the dashboard, which the slash redirect used to
        # serve; a GET redirect is safe (no body to post again).
        routes.append(Route("/admin/ui", _to_dashboard, methods=["GET"]))
    else:
        log.warning("TIERGATE_ADMIN_TOKEN is not set: the admin API is disabled")
        routes.append(Mount("/admin", app=_admin_disabled))
    return _router(routes)


async def _admin_disabled(scope: Scope, receive: Receive, send: Send) -> None:
    """/admin/... while the admin API is off: a 404 as for any unknown URL, so nothing
    else is revealed, but with its own code, so `tiergate admin` can say the API is off
    instead of leaving an operator to wonder whether --url is wrong."""
    error = NotFoundError(
        "The admin API is disabled: the server was started without TIERGATE_ADMIN_TOKEN.",
        code="admin_api_disabled",
    )
    await error_response(error)(scope, receive, send)


async def _to_dashboard(_request: Request) -> Response:
    return RedirectResponse("/admin/ui/")


async def _shutdown_engine(engine: EngineLike) -> None:
    await _maybe_await(engine.shutdown())  # type: ignore[attr-defined]


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors in the OpenAI error shape: routing (unknown path,
    wrong method) and anything else it raises (a malformed body it parsed: 400)."""
    error: GatewayError
    status = getattr(exc, "status_code", None)
    # The headers Starlette gave complete the status (Allow on its 405, RFC 9110 15.5.6).
    headers = getattr(exc, "headers", None)
    if status == 405:
        headers = _with_full_allow(request, headers)
        error = MethodNotAllowedError(
            f"Method {request.method} is not allowed on {request.url.path}.", headers=headers
        )
    elif status == 404:
        error = NotFoundError(
            f"Unknown URL {request.url.path}.", code="unknown_url", headers=headers
        )
    elif status == 413:
        error = PayloadTooLargeError(f"The request body is too large: {exc}", headers=headers)
    elif status is not None and 400 <= status < 500:
        error = InvalidRequestError(
            f"The request is not valid: {getattr(exc, 'detail', exc)}", headers=headers
        )
    else:
        raise exc
    # The middleware adds x-request-id to every response, this one included.
    return error_response(error)


def _with_full_allow(request: Request, headers: dict[str, str] | None) -> dict[str, str]:
    """Starlette's 405 headers with Allow naming every method the path takes.

    Starlette's Allow lists the methods of the first route that matched the path, but the
    gateway declares one route per method (GET and POST /v1/batches are two routes), so
    it would leave out methods the path does take."""
    scope = request.scope
    # The scope as the server gave it: the mounts on the way here rewrote root_path.
    top_scope = {
        "type": "http",
        "method": scope["method"],
        "path": scope["path"],
        "root_path": scope.get("app_root_path", scope.get("root_path", "")),
    }
    allowed = _allowed_methods(_routes_of(request.app), top_scope)
    result = dict(headers or {})
    if allowed:
        result = {name: value for name, value in result.items() if name.lower() != "allow"}
        result["allow"] = ", ".join(sorted(allowed))
    return result


def _allowed_methods(routes: list[BaseRoute], scope: Scope) -> set[str]:
    allowed: set[str] = set()
    for route in routes:
        match, child_scope = route.matches(scope)
        if match is Match.NONE:
            continue
        if isinstance(route, Mount):
            allowed |= _allowed_methods(_routes_of(route.app), {**scope, **child_scope})
        elif isinstance(route, Route) and route.methods:
            allowed |= route.methods
    return allowed


def _routes_of(app: Any) -> list[BaseRoute]:
    """The routes of a Router, of the Starlette app's router, or of _DeferredRoutes."""
    router = getattr(app, "router", None) or app
    return list(getattr(router, "routes", None) or [])


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value
