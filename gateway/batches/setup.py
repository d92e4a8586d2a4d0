"""Assembling the Batch API inside the composition root: store, runner, driver, routes."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.routing import BaseRoute

from gateway.auth import KeyAuthenticator
from gateway.batches.driver import BatchDriver, DriverConfig
from gateway.batches.lines import JobSubmitter, LineRunner
from gateway.batches.routes import BatchDeps, BatchRoutes
from gateway.batches.store import BatchStore
from gateway.batches.validation import ValidationLimits
from gateway.openai.routes import OpenAIRoutes
from gateway.settings import Settings
from gateway.tiers import TierCatalog

FILES_PATH = "/v1/files"


def upload_limits(settings: Settings) -> dict[str, int]:
    """Per-path body limits for the middleware: uploads may exceed max_body_bytes.

    A little above the file cap so that the multipart framing of a file right at the cap
    still gets through to the route, which checks the file itself.
    """
    return {FILES_PATH: settings.max_file_bytes + 64 * 1024}


async def start_batch_api(
    settings: Settings,
    *,
    sessionmaker: async_sessionmaker,
    auth: KeyAuthenticator,
    tiers: TierCatalog,
    openai: OpenAIRoutes,
    dispatcher: JobSubmitter,
    stack: contextlib.AsyncExitStack,
    restore_tiers: Callable[[], Awaitable[None]] | None = None,
) -> list[BaseRoute]:
    """Start this gateway's batch driver (stopped by `stack`) and return the routes.

    `dispatcher` is whatever the routes submit jobs through (submit/cancel);
    `restore_tiers` copies the tier table into the queue again when it lost it. Call this
    after it is started, so that the driver stops first: its in-flight lines are aborted
    while the dispatcher still runs, and its leases are released.
    """
    store = BatchStore(sessionmaker)
    config = DriverConfig(
        lease_s=settings.batch_lease_s,
        limits=ValidationLimits(
            max_lines=settings.batch_max_lines,
            max_bytes=settings.batch_max_input_bytes,
            max_body_bytes=settings.max_body_bytes,
        ),
    )
    driver = BatchDriver(
        store, LineRunner(openai, dispatcher), tiers, config, on_unknown_tier=restore_tiers
    )
    driver.start()
    stack.push_async_callback(driver.aclose)
    deps = BatchDeps(
        auth=auth,
        tiers=tiers,
        store=store,
        driver=driver,
        max_file_bytes=settings.max_file_bytes,
        tenant_file_bytes=settings.tenant_file_bytes,
        model_name=openai.deps.model.model_name,
    )
    return BatchRoutes(deps).routes()
