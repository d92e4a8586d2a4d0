"""Refusal codes the simulated gateway records (the gateway's `code` values).

Admission itself is the real one: `scheduler/admission.py`, called by TieredQueue.admit.
"""

from __future__ import annotations

from scheduler.sim.tiered import NO_CAPACITY, SLO_UNATTAINABLE

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
INVALID_REQUEST = "invalid_request"

__all__ = ["INVALID_REQUEST", "NO_CAPACITY", "QUEUE_FULL", "QUEUE_TIMEOUT", "SLO_UNATTAINABLE"]
