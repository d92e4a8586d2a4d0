"""prepare_heap_for_serving: what exists at start-up leaves the collector's generations."""

from __future__ import annotations

import gc
import warnings
import weakref

from gateway.heap import SERVING_GC_THRESHOLDS, prepare_heap_for_serving


class _Node:
    pass


def _is_tracked_in_a_generation(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_freeze_moves_live_objects_out_of_the_generations_and_collects_the_dead() -> None:
    # Garbage earlier tests left behind is theirs to answer for, not this test's: its
    # finalizers (an unclosed socket's ResourceWarning, say) run here, first.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    survivor: list[object] = [object()]
    cycle = _Node()
    cycle.self = cycle  # type: ignore[attr-defined]  # only the collector can free it
    dead = weakref.ref(cycle)
    del cycle
    thresholds = gc.get_threshold()
    try:
        num_frozen = prepare_heap_for_serving()
        assert num_frozen == gc.get_freeze_count() > 0
        assert dead() is None  # collected first, not frozen for good
        assert not _is_tracked_in_a_generation(survivor)
        after: list[object] = []
        assert _is_tracked_in_a_generation(after)  # new objects are collected as before
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert _is_tracked_in_a_generation(survivor)
