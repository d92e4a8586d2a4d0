"""LocalQueue: tier rank first, then arrival; removal; the wait event."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.request import SamplingParams
from scheduler.job import Job
from scheduler.local_queue import LocalQueue


def _job(job_id: str, rank: int, arrival_s: float, tier: str = "t") -> Job:
    return Job(
        job_id=job_id,
        tenant_id="tenant",
        tier=tier,
        rank=rank,
        weight=1.0,
        prompt_token_ids=(1, 2),
        params=SamplingParams(max_tokens=2),
        arrival_s=arrival_s,
    )


def test_orders_by_rank_then_arrival() -> None:
    queue = LocalQueue()
    queue.push(_job("late-batch", 2, 1.0))
    queue.push(_job("early-batch", 2, 0.5))
    queue.push(_job("interactive", 1, 3.0))
    queue.push(_job("priority", 0, 9.0))
    order = [queue.pop().job_id for _ in range(4)]  # type: ignore[union-attr]
    assert order == ["priority", "interactive", "early-batch", "late-batch"]
    assert queue.pop() is None
    assert len(queue) == 0


def test_equal_arrivals_keep_push_order() -> None:
    queue = LocalQueue()
    for i in range(5):
        queue.push(_job(f"j{i}", 1, 1.0))
    assert [queue.pop().job_id for _ in range(5)] == [f"j{i}" for i in range(5)]  # type: ignore[union-attr]


def test_remove_skips_the_job_and_rejects_duplicates() -> None:
    queue = LocalQueue()
    queue.push(_job("a", 0, 1.0, tier="priority"))
    queue.push(_job("b", 1, 1.0, tier="interactive"))
    with pytest.raises(ValueError, match="already queued"):
        queue.push(_job("a", 0, 2.0))
    assert queue.depth_by_tier() == {"priority": 1, "interactive": 1}
    assert queue.remove("a") is True
    assert queue.remove("a") is False
    assert "a" not in queue
    assert queue.pop().job_id == "b"  # type: ignore[union-attr]
    assert queue.pop() is None


async def test_wait_nonempty_wakes_on_push_and_blocks_when_empty() -> None:
    queue = LocalQueue()
    waiter = asyncio.create_task(queue.wait_nonempty())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    queue.push(_job("a", 0, 1.0))
    await asyncio.wait_for(waiter, 1.0)
    queue.pop()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.wait_nonempty(), 0.02)


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 100), st.booleans()), max_size=40))
def test_pop_order_matches_a_sort(items: list[tuple[int, float, bool]]) -> None:
    queue = LocalQueue()
    kept = []
    for i, (rank, arrival_s, removed) in enumerate(items):
        queue.push(_job(str(i), rank, arrival_s))
        if removed:
            queue.remove(str(i))
        else:
            kept.append((rank, arrival_s, i))
    popped = []
    while (job := queue.pop()) is not None:
        popped.append(job.job_id)
    assert popped == [str(i) for *_, i in sorted(kept)]
