"""Telemetry settings, read once at the edge from the standard OTEL_* variables.

- OTEL_SDK_DISABLED=true turns metrics and tracing off (the /metrics route stays, empty).
- Traces are exported over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT or
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set and OTEL_TRACES_EXPORTER is not "none";
  the exporter itself reads the rest (headers, timeout, compression).
- OTEL_SERVICE_NAME names the service (default "tiergate"); OTEL_TRACES_SAMPLER is
  honoured by the SDK.
- TIERGATE_METRICS_TOP_TENANTS bounds the tenant label (default 20).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class TelemetryConfigError(ValueError):
    """An OTEL_* or TIERGATE_METRICS_* variable holds a value that cannot be used."""


@dataclass(frozen=True)
class TelemetryConfig:
    """What to measure and where to send it."""

    is_enabled: bool = True
    service_name: str = "tiergate"
    is_otlp_traces: bool = False
    top_tenants: int = 20
    # A span exporter built by the caller (an in-process collector, say); wins over OTLP.
    span_exporter: Any = None

    @property
    def is_tracing(self) -> bool:
        return self.is_enabled and (self.is_otlp_traces or self.span_exporter is not None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetryConfig:
        environ = os.environ if environ is None else environ

        def get(name: str) -> str:
            return environ.get(name, "").strip()

        disabled = get("OTEL_SDK_DISABLED").lower()
        if disabled not in ("", "true", "false"):
            raise TelemetryConfigError(f"OTEL_SDK_DISABLED must be true or false, not {disabled!r}")
        exporters = {e.strip() for e in get("OTEL_TRACES_EXPORTER").lower().split(",") if e}
        has_endpoint = bool(
            get("OTEL_EXPORTER_OTLP_ENDPOINT") or get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        top = get("TIERGATE_METRICS_TOP_TENANTS") or "20"
        try:
            top_tenants = int(top)
        except ValueError:
            raise TelemetryConfigError(
                f"TIERGATE_METRICS_TOP_TENANTS={top!r} is not an int"
            ) from None
        if top_tenants < 0:
            raise TelemetryConfigError("TIERGATE_METRICS_TOP_TENANTS must be >= 0")
        return cls(
            is_enabled=disabled != "true",
            service_name=get("OTEL_SERVICE_NAME") or "tiergate",
            is_otlp_traces=has_endpoint and "none" not in exporters,
            top_tenants=top_tenants,
        )
