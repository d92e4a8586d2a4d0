"""Keeping the cyclic garbage collector off the start-up heap of a serving process.

A server imports torch and transformers and loads a model before its first request:
several hundred thousand long-lived objects. CPython's collector walks all of them in
every full collection (over a second on a slow core, stalling every request in flight)
and triggers one each time the objects promoted since the last grow past a quarter of
that heap, so a busy server paid it every few thousand requests, at random. Frozen
(`gc.freeze`), they are never walked again; what requests allocate is collected as
before. A process calls `prepare_heap_for_serving` once, when it is about to serve; the
garbage already unreachable is collected first, so nothing that is dead is kept.

The youngest generation's threshold is raised too (SERVING_GC_THRESHOLDS). At CPython's
700 allocations, a server with a few dozen requests in flight ran a young collection
every few hundred microseconds: each request's objects outlived two of them, were
promoted to the oldest generation and died there, and the promotions alone triggered a
full collection every second. On the gateway benchmark the collector took 15% of the
time and the request rate fell by a quarter within a minute of sustained load; with the
higher threshold most of a request's objects are freed by reference counting before any
collection sees them.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# (young, middle, old) collection thresholds of a serving process; CPython's are
# (700, 10, 10).
SERVING_GC_THRESHOLDS = (10_000, 10, 10)


def prepare_heap_for_serving() -> int:
    """Collect, move every surviving object out of the collector's generations, and set
    SERVING_GC_THRESHOLDS. Returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    num_frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects are left out of garbage collection", num_frozen)
    return num_frozen
