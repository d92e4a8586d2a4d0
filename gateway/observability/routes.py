"""GET /metrics: the Prometheus text exposition of the process's telemetry."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.observability.telemetry import Telemetry


def metrics_routes(telemetry: Telemetry) -> list[BaseRoute]:
    """The /metrics route. Open like /healthz: scrapers reach it inside the cluster."""

    async def metrics(_request: Request) -> Response:
        return Response(telemetry.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return [Route("/metrics", metrics, methods=["GET"])]
