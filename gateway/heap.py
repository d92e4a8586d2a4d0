"""Keeping the cyclic garbage collector off the start-up heap of a serving process.

A server imports torch and transformers and loads a model before its first request:
several hundred thousand long-lived objects. CPython's collector walks all of them in
every full collection (over a second on a slow core, stalling every request in flight)
and triggers one each time the objects promoted since the last grow past a quarter of
that heap, so a busy server paid it every few thousand requests, at random. Frozen
(`gc.freeze`), they are never walked again; what requests allocate is collected as
before. A process calls `freeze_startup_heap` once, when it is about to serve; the
garbage already unreachable is collected first, so nothing that is dead is kept.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then move every surviving object out of the collector's generations.
    Returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    num_frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects are left out of garbage collection", num_frozen)
    return num_frozen
