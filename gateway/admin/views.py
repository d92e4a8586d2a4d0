"""JSON shapes of admin objects. Key views never carry the secret or its digest."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gateway.db.models import ApiKey, Tenant, Tier

TIER_COLUMNS = (
    "name",
    "rank",
    "ttft_slo_ms",
    "tpot_slo_ms",
    "max_queue_ms",
    "max_queued_jobs",
    "completion_window_s",
    "min_share",
    "preemptible",
    "rpm",
    "tpm",
    "max_concurrency",
    "price_input_per_mtok",
    "price_output_per_mtok",
)


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def tier_view(tier: Tier) -> dict[str, Any]:
    return {
        "object": "tier",
        **{name: getattr(tier, name) for name in TIER_COLUMNS},
        "created_at": _time(tier.created_at),
        "updated_at": _time(tier.updated_at),
    }


def tenant_view(tenant: Tenant) -> dict[str, Any]:
    return {
        "object": "tenant",
        "id": tenant.id,
        "name": tenant.name,
        "tier": tenant.tier,
        "weight": tenant.weight,
        "rpm": tenant.rpm,
        "tpm": tenant.tpm,
        "max_concurrency": tenant.max_concurrency,
        "status": tenant.status,
        "created_at": _time(tenant.created_at),
        "updated_at": _time(tenant.updated_at),
    }


def key_view(key: ApiKey) -> dict[str, Any]:
    return {
        "object": "api_key",
        "id": key.id,
        "tenant_id": key.tenant_id,
        "name": key.name,
        "prefix": key.prefix,
        "created_at": _time(key.created_at),
        "expires_at": _time(key.expires_at),
        "revoked_at": _time(key.revoked_at),
    }


def list_view(items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"object": "list", "data": items, **extra}
