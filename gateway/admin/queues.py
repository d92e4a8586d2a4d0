"""/admin/v1/queues: live queue depth per tier and tenant, fleet capacity, each live
worker's latest report (heartbeat age, measured rates, engine sequences, KV-cache use,
backlog held in its engine), and the queue's totals since it began (lease expirations,
requeues, jobs abandoned with their gateway).

Also the queue depth and totals telemetry reads: `QueueMonitor` keeps a snapshot
refreshed in the background, because metric callbacks are synchronous and must not wait
on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Mapping, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.errors import AuthenticationError, error_response
from scheduler.backend import QueueBackend, QueueTotals, TierDepth, WorkerReport

log = logging.getLogger(__name__)


def _check_admin(admin_token: str, request: Request) -> None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    ok = bool(admin_token) and scheme.lower() == "bearer"
    if not hmac.compare_digest(token.strip().encode(), admin_token.encode()) or not ok:
        raise AuthenticationError("Invalid or missing admin token", code="invalid_admin_token")


def worker_view(report: WorkerReport) -> dict:
    """One worker in GET /admin/v1/queues. Backlog: tokens its engine holds and has not
    served yet (prompts not prefilled, outputs still to generate), all ranks together."""
    return {
        "id": report.worker_id,
        "heartbeat_age_ms": report.age_ms,
        "prefill_tokens_per_s": report.prefill_tokens_per_s,
        "decode_tokens_per_s": report.decode_tokens_per_s,
        "num_running": report.num_running,
        "num_waiting": report.num_waiting,
        # Requests its engine would start at its next step: SLO admission counts the
        # decodes ahead of a new request only when none is free.
        "num_free_seqs": report.num_free_seqs,
        # With none free, when its running requests are expected to free the next one,
        # or by when they do at TIERGATE_SLOT_WAIT_QUANTILE (scheduler.slot_release; null:
        # nothing runs), and how many of them a better rank may preempt instead.
        "next_release_ms": report.release_ms[0] if report.release_ms else None,
        "num_preemptible_seqs": report.num_preemptible_seqs,
        "kv_cache_usage": report.kv_cache_usage,
        "step_token_budget": report.step_token_budget,
        "num_preemptions": report.num_preemptions,
        "num_recomputed_tokens": report.num_recomputed_tokens,
        "backlog_prefill_tokens": sum(report.unprefilled_tokens_by_rank.values()),
        "backlog_decode_tokens": sum(report.decode_tokens_by_rank.values()),
    }


def totals_view(totals: QueueTotals) -> dict[str, int]:
    """The queue's totals as /admin/v1/queues and the metrics name them."""
    return {
        "lease_expirations": totals.lease_expirations,
        "requeues": totals.requeues,
        "abandoned_jobs": totals.abandoned,
    }


def queues_view(
    depth: Mapping[str, TierDepth],
    workers: Sequence[WorkerReport] = (),
    totals: QueueTotals | None = None,
) -> dict:
    """The JSON body of GET /admin/v1/queues. The fleet's figures are the listed
    workers' sums: read apart (fleet_capacity), a report renewed between the two reads
    made them disagree with the list."""
    return {
        "object": "queues",
        "tiers": {
            tier: {
                "queued_jobs": d.num_jobs,
                "tenants": {
                    tenant: {
                        "queued_jobs": t.num_jobs,
                        "queued_prompt_tokens": t.num_prefill_tokens,
                        "queued_max_tokens": t.num_decode_tokens,
                    }
                    for tenant, t in sorted(d.tenants.items())
                },
            }
            for tier, d in sorted(depth.items())
        },
        "workers": {
            "live": len(workers),
            "prefill_tokens_per_s": sum(w.prefill_tokens_per_s for w in workers),
            "decode_tokens_per_s": sum(w.decode_tokens_per_s for w in workers),
            "num_free_seqs": sum(w.num_free_seqs for w in workers),
            "data": [worker_view(report) for report in workers],
        },
        "totals": totals_view(totals or QueueTotals()),
    }


def queue_routes(backend: QueueBackend, admin_token: str) -> list[BaseRoute]:
    """GET /queues (mounted under /admin/v1), admin token required."""

    async def queues(request: Request) -> Response:
        try:
            _check_admin(admin_token, request)
            depth, workers, totals = await asyncio.gather(
                backend.depth(), backend.worker_reports(), backend.totals()
            )
            return JSONResponse(queues_view(depth, workers, totals))
        except Exception as exc:
            return error_response(exc)

    return [Route("/queues", queues, methods=["GET"])]


class QueueMonitor:
    """Queued jobs per tier, the live workers' reports and the queue's totals, refreshed
    every `interval_s` for synchronous readers (metric callbacks, the dashboard's
    snapshot)."""

    def __init__(self, backend: QueueBackend, *, interval_s: float = 1.0) -> None:
        self._backend = backend
        self._interval_s = interval_s
        self._depth: dict[str, int] = {}
        self._workers: dict[str, WorkerReport] = {}
        self._totals: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def depth_by_tier(self) -> Mapping[str, int]:
        return dict(self._depth)

    def workers(self) -> Mapping[str, WorkerReport]:
        """Worker id -> latest report: on a gateway without an engine of its own, the
        workers its metrics and dashboard show."""
        return dict(self._workers)

    def totals(self) -> Mapping[str, int]:
        """The queue's totals (totals_view), empty until first read."""
        return dict(self._totals)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="queue-monitor")

    async def _run(self) -> None:
        while True:
            try:
                depth, reports, totals = await asyncio.gather(
                    self._backend.depth(), self._backend.worker_reports(), self._backend.totals()
                )
                self._depth = {tier: d.num_jobs for tier, d in depth.items()}
                self._workers = {report.worker_id: report for report in reports}
                self._totals = totals_view(totals)
            except Exception as exc:  # the queue may be down; keep the last snapshot
                log.debug("queue state unavailable: %r", exc)
            await asyncio.sleep(self._interval_s)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
