"""Observability: metrics (Prometheus via OpenTelemetry), traces (OTLP), JSON logs."""

from gateway.observability.config import TelemetryConfig, TelemetryConfigError
from gateway.observability.logs import JsonFormatter, configure_logging
from gateway.observability.middleware import TelemetryMiddleware
from gateway.observability.routes import metrics_routes
from gateway.observability.telemetry import Telemetry
from gateway.observability.tracing import RequestTimeline

__all__ = [
    "JsonFormatter",
    "RequestTimeline",
    "Telemetry",
    "TelemetryConfig",
    "TelemetryConfigError",
    "TelemetryMiddleware",
    "configure_logging",
    "metrics_routes",
]
