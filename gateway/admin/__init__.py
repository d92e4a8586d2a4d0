"""Admin API: tiers, tenants and API keys over JSON, behind the admin bearer token."""

from gateway.admin.deps import AdminDeps
from gateway.admin.routes import admin_routes

__all__ = ["AdminDeps", "admin_routes"]
