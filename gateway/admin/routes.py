"""Admin API handlers for tiers, tenants and keys (mounted at /admin/v1).

Every handler runs behind the admin bearer check and turns any exception into the one
error table's response. Writes invalidate the in-process TierCatalog and
KeyAuthenticator caches after they commit, so they apply at once in this process.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm.exc import StaleDataError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.deps import AdminDeps
from gateway.admin.validation import (
    KEY_FIELDS,
    KEY_ID,
    TENANT_FIELDS,
    TENANT_ID,
    TIER_FIELDS,
    TIER_NAME,
    parse_fields,
    query_int,
    read_json_object,
)
from gateway.admin.views import key_view, list_view, tenant_view, tier_view
from gateway.auth import generate_api_key
from gateway.db import repo
from gateway.db.models import Tenant, Tier
from gateway.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    error_response,
)

Handler = Callable[[Request], Awaitable[Response]]

# Defaults of a tier created without them: no SLO, no queue cap, no limits, free, not
# preemptible.
TIER_DEFAULTS: dict[str, Any] = {
    "ttft_slo_ms": None,
    "tpot_slo_ms": None,
    "max_queue_ms": None,
    "max_queued_jobs": None,
    "completion_window_s": None,
    "min_share": 0.0,
    "preemptible": False,
    "rpm": None,
    "tpm": None,
    "max_concurrency": None,
    "price_input_per_mtok": 0.0,
    "price_output_per_mtok": 0.0,
}


def _check_admin(deps: AdminDeps, request: Request) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # An empty configured token disables the admin API rather than accepting anyone.
    ok = bool(deps.admin_token) and scheme.lower() == "bearer"
    if not hmac.compare_digest(token.strip().encode(), deps.admin_token.encode()) or not ok:
        raise AuthenticationError("Invalid or missing admin token", code="invalid_admin_token")


def _guarded(deps: AdminDeps, handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        try:
            _check_admin(deps, request)
            return await handler(request)
        except Exception as exc:
            return error_response(exc)

    return endpoint


def _path_id(request: Request, name: str, pattern, what: str) -> str:
    value = request.path_params[name]
    if not pattern.fullmatch(value):
        raise NotFoundError(f"No {what} {value!r}", param=name)
    return value


async def _check_min_share(session, name: str, min_share: float) -> None:
    # Locked first: two changes at once would each see the other's old share.
    await repo.lock_tiers(session)
    total = await repo.sum_min_share(session, excluding=name) + min_share
    if total > 1.0 + 1e-9:
        raise InvalidRequestError(
            f"min_share over all tiers would be {total:g}; it may not exceed 1",
            param="min_share",
        )


log = logging.getLogger(__name__)

# When a weight PATCH is applied to the queue again, in seconds after it. Every enqueue
# writes its job's weight as the tenant's, so one by a gateway that has not heard of the
# change yet sets the old weight back for the tenant's whole backlog. Gateways drop their
# caches at ConfigSync's next poll (every 250 ms) after the bump that follows the commit,
# and such enqueues land in the first few hundred milliseconds: the re-applies at 0.5 s
# and 0.9 s keep the documented "within a second". The later ones cover a request that
# authenticated before the drop and took long to enqueue (tokenizing a large prompt) and,
# at 5 s (the auth cache's default TTL), a gateway that missed the bump.
WEIGHT_REAPPLY_S = (0.5, 0.9, 1.5, 5.0)


class WeightReapplier:
    """Applies each weight PATCH to the queue at once and again at WEIGHT_REAPPLY_S.

    A later PATCH of a tenant supersedes the re-applies of its earlier ones in this
    process: they would set the older weight back over the newer one. A re-apply sets
    the weight `read_weight` finds committed then (None: the tenant is gone, nothing to
    do), so that a later PATCH made through another gateway is not undone either; without
    `read_weight`, the PATCH's own."""

    def __init__(
        self,
        queue: Any,
        *,
        read_weight: Callable[[str], Awaitable[float | None]] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._queue = queue
        self._read_weight = read_weight
        self._sleep = sleep
        # The task re-applying each tenant's latest PATCH; and every task still running,
        # held so that none is garbage-collected while it sleeps.
        self._latest: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def apply(self, tenant_id: str, weight: float) -> None:
        """Set the tenant's committed `weight` on the queue now, and later again.

        The re-applies start first: they stop an earlier PATCH's, and apply this one
        should the queue be back after failing now (the PATCH answers 503 then)."""
        self._start(tenant_id, weight)
        await self._queue.set_tenant_weight(tenant_id, weight)

    def _start(self, tenant_id: str, weight: float) -> None:
        task = asyncio.get_running_loop().create_task(self._reapply(tenant_id, weight))
        self._latest[tenant_id] = task
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._forget(tenant_id, done))

    def _forget(self, tenant_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._latest.get(tenant_id) is task:
            del self._latest[tenant_id]

    async def _reapply(self, tenant_id: str, weight: float) -> None:
        waited_s = 0.0
        for at_s in WEIGHT_REAPPLY_S:
            await self._sleep(at_s - waited_s)
            waited_s = at_s
            # Checked after each sleep rather than cancelled by the later PATCH: a cancel
            # could land in the middle of a queue call.
            if self._latest.get(tenant_id) is not asyncio.current_task():
                return
            try:
                if self._read_weight is not None:
                    committed = await self._read_weight(tenant_id)
                    if committed is None:
                        return  # deleted since
                    weight = committed
                await self._queue.set_tenant_weight(tenant_id, weight)
            except Exception as exc:  # the queue away: the tenant's next PATCH applies it
                log.warning("re-applying tenant %s's weight failed: %r", tenant_id, exc)


def _build_routes(deps: AdminDeps) -> list[BaseRoute]:
    sessions = deps.sessionmaker

    async def committed_weight(tenant_id: str) -> float | None:
        async with sessions() as session:
            return await session.scalar(select(Tenant.weight).where(Tenant.id == tenant_id))

    reapplier = None
    if deps.queue is not None:
        reapplier = WeightReapplier(deps.queue, read_weight=committed_weight)

    # --- tiers ---------------------------------------------------------------------

    async def list_tiers(request: Request) -> Response:
        async with sessions() as session:
            return JSONResponse(list_view([tier_view(t) for t in await repo.list_tiers(session)]))

    async def create_tier(request: Request) -> Response:
        values = parse_fields(
            await read_json_object(request), TIER_FIELDS, required=("name", "rank")
        )
        async with sessions() as session:
            if await repo.get_tier(session, values["name"]) is not None:
                raise ConflictError(f"Tier {values['name']!r} already exists", param="name")
            await _check_min_share(session, values["name"], values.get("min_share", 0.0))
            tier = Tier(**{**TIER_DEFAULTS, **values})
            session.add(tier)
            try:
                await session.commit()
            except IntegrityError:
                raise ConflictError(f"Tier {values['name']!r} already exists") from None
        deps.tiers.invalidate()
        return JSONResponse(tier_view(tier), status_code=201)

    async def _tier_or_404(session, request: Request) -> Tier:
        name = _path_id(request, "name", TIER_NAME, "tier")
        tier = await repo.get_tier(session, name)
        if tier is None:
            raise NotFoundError(f"No tier {name!r}", param="name")
        return tier

    async def get_tier(request: Request) -> Response:
        async with sessions() as session:
            return JSONResponse(tier_view(await _tier_or_404(session, request)))

    async def update_tier(request: Request) -> Response:
        changes = parse_fields(await read_json_object(request), TIER_FIELDS)
        async with sessions() as session:
            tier = await _tier_or_404(session, request)
            name = tier.name
            if changes.get("name", name) != name:
                raise InvalidRequestError("A tier cannot be renamed", param="name")
            if "min_share" in changes:
                await _check_min_share(session, name, changes["min_share"])
            repo.apply_changes(tier, changes)
            try:
                await session.commit()
            except StaleDataError:  # deleted since it was read: the UPDATE matched no row
                raise NotFoundError(f"No tier {name!r}", param="name") from None
        deps.tiers.invalidate()
        return JSONResponse(tier_view(tier))

    async def delete_tier(request: Request) -> Response:
        async with sessions() as session:
            # The name, not the instance: a failed commit expires the instance, and
            # reading it again would need the rolled-back transaction.
            name = (await _tier_or_404(session, request)).name
            num_tenants = await repo.count_tenants_on_tier(session, name)
            if num_tenants:
                raise ConflictError(
                    f"Tier {name!r} is used by {num_tenants} tenant(s); move them first",
                    code="tier_in_use",
                )
            num_batches = await repo.count_open_batches_on_tier(session, name)
            if num_batches:
                raise ConflictError(
                    f"Tier {name!r} runs {num_batches} unfinished batch(es); cancel them "
                    "or let them end first",
                    code="tier_in_use",
                )
            try:
                # The row count, not the read above, says whether this call deleted it.
                deleted = await repo.delete_tier(session, name)
                await session.commit()
            except IntegrityError:  # a tenant joined the tier meanwhile
                raise ConflictError(f"Tier {name!r} is in use", code="tier_in_use") from None
            if not deleted:
                raise NotFoundError(f"No tier {name!r}", param="name")
        deps.tiers.invalidate()
        return JSONResponse({"object": "tier", "name": name, "deleted": True})

    # --- tenants -------------------------------------------------------------------

    def _unknown_tier(name: str) -> InvalidRequestError:
        return InvalidRequestError(f"Unknown tier {name!r}", param="tier", code="unknown_tier")

    async def _check_tier_exists(session, name: str) -> None:
        if await repo.get_tier(session, name) is None:
            raise _unknown_tier(name)

    async def _tenant_write_conflict(
        session, *, name: str | None, tier: str | None
    ) -> InvalidRequestError | ConflictError:
        """Why a tenant write that passed its checks failed at a constraint: a call in
        between deleted its tier (answered as the check would have) or took its name."""
        await session.rollback()
        if tier is not None and await repo.get_tier(session, tier) is None:
            return _unknown_tier(tier)
        if name is not None and await repo.get_tenant_by_name(session, name) is not None:
            return ConflictError(f"Tenant {name!r} already exists", param="name")
        return ConflictError("Tenant name or tier changed concurrently; try again")

    async def list_tenants(request: Request) -> Response:
        limit = query_int(request, "limit", default=100, min=1, max=1000)
        after = request.query_params.get("after")
        if after is not None and not TENANT_ID.fullmatch(after):
            raise InvalidRequestError("after must be a tenant id", param="after")
        async with sessions() as session:
            tenants = await repo.list_tenants(session, limit=limit + 1, after=after)
        page = tenants[:limit]
        return JSONResponse(
            list_view(
                [tenant_view(t) for t in page],
                has_more=len(tenants) > limit,
                last_id=page[-1].id if page else None,
            )
        )

    async def create_tenant(request: Request) -> Response:
        values = parse_fields(
            await read_json_object(request), TENANT_FIELDS, required=("name", "tier")
        )
        async with sessions() as session:
            await _check_tier_exists(session, values["tier"])
            if await repo.get_tenant_by_name(session, values["name"]) is not None:
                raise ConflictError(f"Tenant {values['name']!r} already exists", param="name")
            tenant = Tenant(**{"weight": 1.0, "status": "active", **values})
            session.add(tenant)
            try:
                await session.commit()
            except IntegrityError:
                raise await _tenant_write_conflict(
                    session, name=values["name"], tier=values["tier"]
                ) from None
        return JSONResponse(tenant_view(tenant), status_code=201)

    async def _tenant_or_404(session, request: Request) -> Tenant:
        tenant_id = _path_id(request, "tenant_id", TENANT_ID, "tenant")
        tenant = await repo.get_tenant(session, tenant_id)
        if tenant is None:
            raise NotFoundError(f"No tenant {tenant_id!r}", param="tenant_id")
        return tenant

    async def get_tenant(request: Request) -> Response:
        async with sessions() as session:
            return JSONResponse(tenant_view(await _tenant_or_404(session, request)))

    async def update_tenant(request: Request) -> Response:
        changes = parse_fields(await read_json_object(request), TENANT_FIELDS)
        async with sessions() as session:
            tenant = await _tenant_or_404(session, request)
            tenant_id = tenant.id
            if "tier" in changes:
                await _check_tier_exists(session, changes["tier"])
            renamed = changes.get("name", tenant.name) != tenant.name
            if renamed and await repo.get_tenant_by_name(session, changes["name"]) is not None:
                raise ConflictError(f"Tenant {changes['name']!r} already exists", param="name")
            repo.apply_changes(tenant, changes)
            try:
                await session.commit()
            except StaleDataError:  # deleted since it was read: the UPDATE matched no row
                raise NotFoundError(f"No tenant {tenant_id!r}", param="tenant_id") from None
            except IntegrityError:
                raise await _tenant_write_conflict(
                    session, name=changes["name"] if renamed else None, tier=changes.get("tier")
                ) from None
        deps.auth.invalidate_tenant(tenant.id)
        if "weight" in changes and reapplier is not None:
            # Jobs already queued or running take the new weight now, fleet-wide with the
            # Redis queue; new jobs carry it once the gateways' caches drop (within a
            # second). Also when unchanged, so that repeating a PATCH that answered 503
            # (the queue unreachable after the commit) applies it.
            await reapplier.apply(tenant.id, tenant.weight)
        return JSONResponse(tenant_view(tenant))

    async def delete_tenant(request: Request) -> Response:
        async with sessions() as session:
            tenant_id = (await _tenant_or_404(session, request)).id
            # Of deletes at once, all pass the read above; only one deletes the row.
            if not await repo.delete_tenant(session, tenant_id):
                raise NotFoundError(f"No tenant {tenant_id!r}", param="tenant_id")
            await session.commit()
        deps.auth.invalidate_tenant(tenant_id)
        return JSONResponse({"object": "tenant", "id": tenant_id, "deleted": True})

    # --- keys ----------------------------------------------------------------------

    async def create_key(request: Request) -> Response:
        values = parse_fields(await read_json_object(request, allow_empty=True), KEY_FIELDS)
        if "expires_at" in values and "expires_in_s" in values:
            raise InvalidRequestError(
                "Give expires_at or expires_in_s, not both", param="expires_in_s"
            )
        expires_at = values.get("expires_at")
        if "expires_in_s" in values:
            expires_at = datetime.now(UTC) + timedelta(seconds=values["expires_in_s"])
        elif expires_at is not None and expires_at <= datetime.now(UTC):
            # A key born expired can only ever answer 401; the caller meant something else.
            raise InvalidRequestError("expires_at is in the past", param="expires_at")
        secret, digest, prefix = generate_api_key()
        async with sessions() as session:
            tenant_id = (await _tenant_or_404(session, request)).id
            try:
                key = await repo.add_api_key(
                    session,
                    tenant_id=tenant_id,
                    digest=digest,
                    prefix=prefix,
                    name=values.get("name", ""),
                    expires_at=expires_at,
                )
                await session.commit()
            except IntegrityError:
                # The tenant's foreign key: deleted since it was read.
                await session.rollback()
                if await repo.get_tenant(session, tenant_id) is None:
                    raise NotFoundError(f"No tenant {tenant_id!r}", param="tenant_id") from None
                raise
        # The only time the secret leaves the server.
        return JSONResponse({**key_view(key), "secret": secret}, status_code=201)

    async def list_keys(request: Request) -> Response:
        async with sessions() as session:
            tenant = await _tenant_or_404(session, request)
            keys = await repo.list_api_keys(session, tenant.id)
        return JSONResponse(list_view([key_view(k) for k in keys]))

    async def revoke_key(request: Request) -> Response:
        key_id = _path_id(request, "key_id", KEY_ID, "key")
        async with sessions() as session:
            key = await repo.revoke_api_key(session, key_id)
            if key is None:
                raise NotFoundError(f"No key {key_id!r}", param="key_id")
            await session.commit()
        deps.auth.invalidate_key(key.id)
        return JSONResponse(key_view(key))

    table: list[tuple[str, str, Handler]] = [
        ("/tiers", "GET", list_tiers),
        ("/tiers", "POST", create_tier),
        ("/tiers/{name}", "GET", get_tier),
        ("/tiers/{name}", "PATCH", update_tier),
        ("/tiers/{name}", "DELETE", delete_tier),
        ("/tenants", "GET", list_tenants),
        ("/tenants", "POST", create_tenant),
        ("/tenants/{tenant_id}", "GET", get_tenant),
        ("/tenants/{tenant_id}", "PATCH", update_tenant),
        ("/tenants/{tenant_id}", "DELETE", delete_tenant),
        ("/tenants/{tenant_id}/keys", "POST", create_key),
        ("/tenants/{tenant_id}/keys", "GET", list_keys),
        ("/keys/{key_id}", "DELETE", revoke_key),
    ]
    return [
        Route(path, _guarded(deps, handler), methods=[method]) for path, method, handler in table
    ]


def admin_routes(deps: AdminDeps) -> list[BaseRoute]:
    """The admin API's routes, to mount at /admin/v1."""
    return _build_routes(deps)
