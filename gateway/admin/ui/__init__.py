"""The operators' dashboard at /admin/ui: live charts and the tier editor."""

from gateway.admin.ui.routes import dashboard_routes

__all__ = ["dashboard_routes"]
