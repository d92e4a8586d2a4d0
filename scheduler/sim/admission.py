"""SLO admission for the simulated gateway: refuse what the fleet cannot start in time.

The predicted queue wait of a new request is the prompt work the policy would serve
before it (the backend's `work_ahead`) divided by the rate at which the fleet has been
taking prompt work off the queue over a recent window. A request whose predicted wait
exceeds `headroom` × its TTFT SLO is refused with `slo_unattainable`. Measuring the
drain rate rather than a peak rate makes the estimate honest under any bottleneck
(sequence slots, KV blocks or compute).
"""

from __future__ import annotations

from collections import deque

SLO_UNATTAINABLE = "slo_unattainable"
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
INVALID_REQUEST = "invalid_request"


class DrainRate:
    """Prompt tokens dispatched per second over a sliding window of the virtual clock."""

    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, now_s: float, num_tokens: int) -> None:
        self._events.append((now_s, num_tokens))
        self._total += num_tokens
        self._expire(now_s)

    def _expire(self, now_s: float) -> None:
        while self._events and self._events[0][0] < now_s - self.window_s:
            self._total -= self._events.popleft()[1]

    def tokens_per_s(self, now_s: float) -> float:
        self._expire(now_s)
        span = min(self.window_s, max(now_s, 1e-9))
        return self._total / span


def predicted_wait_s(num_prefill_tokens_ahead: float, drain_tokens_per_s: float) -> float:
    """Seconds until the work ahead is taken off the queue (inf if nothing drains)."""
    if num_prefill_tokens_ahead <= 0:
        return 0.0
    if drain_tokens_per_s <= 0:
        return float("inf")
    return num_prefill_tokens_ahead / drain_tokens_per_s


def admit(ttft_slo_ms: float | None, wait_s: float, *, headroom: float = 0.7) -> str | None:
    """None to admit, or the refusal code."""
    if ttft_slo_ms is None:
        return None
    if wait_s * 1000 > headroom * ttft_slo_ms:
        return SLO_UNATTAINABLE
    return None
