"""SQLAlchemy models for tiers, tenants, API keys, usage records and their hourly rollup.

The same schema runs on SQLite (the embedded default) and PostgreSQL; the Alembic
versions in migrations/ create it, and a test checks the two agree.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TENANT_STATUSES = ("active", "suspended")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A public object id such as `ten_3f9a...`: a type prefix and 96 random bits."""
    return f"{prefix}_{secrets.token_hex(12)}"


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps are aware UTC in Python on every backend.

    SQLite keeps no time zone, so values come back naive; they were written as UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tier(Base):
    """A service tier: scheduling rank, SLOs, default per-tenant limits and prices."""

    __tablename__ = "tiers"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)  # 0 is most important
    ttft_slo_ms: Mapped[float | None] = mapped_column(Float)
    tpot_slo_ms: Mapped[float | None] = mapped_column(Float)
    max_queue_ms: Mapped[float | None] = mapped_column(Float)
    # Queued jobs the tier holds at most, all tenants together (migration 0006).
    max_queued_jobs: Mapped[int | None] = mapped_column(Integer)
    completion_window_s: Mapped[int | None] = mapped_column(Integer)
    min_share: Mapped[float] = mapped_column(Float, default=0.0)
    preemptible: Mapped[bool] = mapped_column(Boolean, default=False)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    price_input_per_mtok: Mapped[float] = mapped_column(Float, default=0.0)
    price_output_per_mtok: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(
        UTCDateTime, default=utcnow, server_default=func.now()
    )
    updated_at: Mapped[datetime] = mapped_column(
        UTCDateTime, default=utcnow, onupdate=utcnow, server_default=func.now()
    )


class Tenant(Base):
    """A customer: one tier, a fair-share weight, optional limit overrides, a status."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # RESTRICT: a tier still in use cannot be deleted (the admin API answers 409).
    tier: Mapped[str] = mapped_column(
        String(32), ForeignKey("tiers.name", ondelete="RESTRICT"), index=True
    )
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(
        UTCDateTime, default=utcnow, server_default=func.now()
    )
    updated_at: Mapped[datetime] = mapped_column(
        UTCDateTime, default=utcnow, onupdate=utcnow, server_default=func.now()
    )


class ApiKey(Base):
    """An API key, kept only as its SHA-256 digest and a short display prefix.

    No last-used column on purpose: it would cost a write on every request.
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    digest: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(16))  # e.g. "tg-AbCdEf", for humans
    name: Mapped[str] = mapped_column(String(100), default="")
    created_at: Mapped[datetime] = mapped_column(
        UTCDateTime, default=utcnow, server_default=func.now()
    )
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class UsageRow(Base):
    """One finished (or refused) request. Not a foreign key to tenants: usage is an
    audit trail and outlives a deleted tenant or tier."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_usage_records_tier_created_at", "tier", "created_at"),
        # /admin/v1/usage: a time range over every tenant (migration 0004).
        Index(
            "ix_usage_records_created_at",
            "created_at",
            postgresql_include=[
                "tenant_id",
                "tier",
                "outcome",
                "prompt_tokens",
                "completion_tokens",
                "ttft_ms",
                "e2e_ms",
            ],
        ),
    )

    # SQLite only autoincrements an INTEGER PRIMARY KEY.
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str] = mapped_column(String(40))
    tier: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    queue_wait_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float] = mapped_column(Float)
    outcome: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Choices (`n`) of the request: completion_tokens sums them, and the longest one's
    # tokens (NULL for one choice) are what its TPOT divides by (migration 0007).
    num_choices: Mapped[int] = mapped_column(SmallInteger, server_default="1")
    longest_choice_tokens: Mapped[int | None] = mapped_column(Integer)
    # Whether the request met its tier's SLO as the tier stood when the record was
    # written (migration 0005 evaluated older rows against the tiers of that day). NULL:
    # written by a gateway older than 0005 during a rolling upgrade, so neither evaluated
    # nor in usage_hourly; gateway.usage.rebuild_usage_rollup repairs those hours.
    slo_met: Mapped[bool | None] = mapped_column(Boolean)
    # Its billed tokens at the prices its tier had when it ran (migration 0008), so that
    # a price change or a deleted tier does not re-price history. NULL: written by a
    # gateway older than 0008 during a rolling upgrade (rebuild_usage_rollup prices it).
    # In billionths of the currency (TokenPrices.cost_nanos): exact sums.
    cost_nanos: Mapped[int | None] = mapped_column(BigInteger)


class UsageHourly(Base):
    """usage_records summed per UTC hour, tenant and tier, so that /admin/v1/usage reads
    one row per (hour, tenant, tier) instead of one per request. The UsageWriter adds
    each batch in the same transaction that inserts its records (migration 0005)."""

    __tablename__ = "usage_hourly"
    __table_args__ = (
        PrimaryKeyConstraint("hour", "tenant_id", "tier", name="pk_usage_hourly"),
        Index("ix_usage_hourly_tenant_id_hour", "tenant_id", "hour"),
    )

    hour: Mapped[datetime] = mapped_column(UTCDateTime)  # start of the hour, UTC
    tenant_id: Mapped[str] = mapped_column(String(40))
    tier: Mapped[str] = mapped_column(String(32))
    requests: Mapped[int] = mapped_column(BigInteger)
    refusals: Mapped[int] = mapped_column(BigInteger)  # outcome "rejected:<code>"
    aborted: Mapped[int] = mapped_column(BigInteger)  # outcome "aborted"
    input_tokens: Mapped[int] = mapped_column(BigInteger)  # of requests not refused
    output_tokens: Mapped[int] = mapped_column(BigInteger)  # of requests not refused
    slo_met: Mapped[int] = mapped_column(BigInteger)
    cost_nanos: Mapped[int] = mapped_column(BigInteger, server_default="0")
