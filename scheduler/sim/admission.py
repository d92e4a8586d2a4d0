"""Refusal codes the simulated gateway records (the gateway's `code` values).

Admission itself is the real one: rate limits are `scheduler/rate_limit.py` (see
rate_limits.py), SLO admission is `scheduler/admission.py`, called by TieredQueue.admit.
"""

from __future__ import annotations

from scheduler.sim.tiered import NO_CAPACITY, SLO_UNATTAINABLE

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
INVALID_REQUEST = "invalid_request"
# A tenant over its own quota (RPM/TPM, or its concurrency cap).
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
CONCURRENCY_LIMIT_EXCEEDED = "concurrency_limit_exceeded"
OVER_QUOTA_CODES = frozenset({RATE_LIMIT_EXCEEDED, CONCURRENCY_LIMIT_EXCEEDED})

__all__ = [
    "CONCURRENCY_LIMIT_EXCEEDED",
    "INVALID_REQUEST",
    "NO_CAPACITY",
    "OVER_QUOTA_CODES",
    "QUEUE_FULL",
    "QUEUE_TIMEOUT",
    "RATE_LIMIT_EXCEEDED",
    "SLO_UNATTAINABLE",
]
