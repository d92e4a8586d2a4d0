"""Bounded tenant labels for metrics: the busiest tenants by name, everyone else "other".

A Prometheus series per tenant would let one tenant-creating script explode the metric
store, and the OpenTelemetry SDK keeps every attribute set it has seen for the life of
the process. So a tenant gets its own label only while it is among the `top_n` busiest
(by requests, counted with the Space-Saving heavy-hitter sketch in bounded memory), and
the set of names ever handed out is capped at `max_labels`; past it, new names become
"other" too. The SDK's own cardinality limit is the last backstop.
"""

from __future__ import annotations

import time

OTHER = "other"


class TenantLabels:
    """Maps a tenant id to itself (if it is a heavy hitter) or to "other"."""

    def __init__(
        self, top_n: int = 20, *, max_labels: int | None = None, refresh_s: float = 10.0
    ) -> None:
        if top_n < 0:
            raise ValueError("top_n must be >= 0")
        self.top_n = top_n
        self.max_labels = max_labels if max_labels is not None else 4 * top_n
        self._refresh_s = refresh_s
        # Space-Saving: at most `capacity` counters; a newcomer evicts the smallest and
        # inherits its count, so every true heavy hitter stays in the table.
        self._capacity = max(4 * top_n, 16)
        self._counts: dict[str, int] = {}
        self._top: frozenset[str] = frozenset()
        self._ever_labelled: set[str] = set()
        self._refreshed_at = float("-inf")

    def observe(self, tenant_id: str) -> str:
        """Count one request of `tenant_id` and return the label to use for it."""
        counts = self._counts
        if tenant_id in counts:
            counts[tenant_id] += 1
        elif len(counts) < self._capacity:
            counts[tenant_id] = 1
        else:
            smallest = min(counts, key=counts.__getitem__)
            counts[tenant_id] = counts.pop(smallest) + 1
        now = time.monotonic()
        if now - self._refreshed_at >= self._refresh_s or (
            tenant_id not in self._top and len(self._top) < self.top_n
        ):
            self._refresh(now)
        return self.label(tenant_id)

    def label(self, tenant_id: str) -> str:
        """The label for `tenant_id` without counting a request."""
        return tenant_id if tenant_id in self._top else OTHER

    def _refresh(self, now: float) -> None:
        self._refreshed_at = now
        ranked = sorted(self._counts, key=self._counts.__getitem__, reverse=True)
        top: set[str] = set()
        for tenant_id in ranked:
            if len(top) >= self.top_n:
                break
            if tenant_id in self._ever_labelled or len(self._ever_labelled) < self.max_labels:
                self._ever_labelled.add(tenant_id)
                top.add(tenant_id)
        self._top = frozenset(top)
