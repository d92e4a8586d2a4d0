"""SQL storage of the gateway: models, engine/session factory, repository functions."""

from gateway.db import batch_models  # noqa: F401  (puts the Batch API tables on Base.metadata)
from gateway.db.models import ApiKey, Base, Tenant, Tier, UsageRow
from gateway.db.session import create_db_engine, create_sessionmaker

__all__ = [
    "ApiKey",
    "Base",
    "Tenant",
    "Tier",
    "UsageRow",
    "create_db_engine",
    "create_sessionmaker",
]
