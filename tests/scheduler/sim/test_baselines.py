"""The baseline queue policies: FCFS, strict priority and VTC fair share."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams
from scheduler.job import Job
from scheduler.sim.baselines import FcfsQueue, PriorityQueue, VtcQueue


def _job(
    job_id: str,
    tenant: str,
    *,
    rank: int = 0,
    arrival_s: float = 0.0,
    weight: float = 1.0,
    prompt: int = 10,
    max_queue_ms: float | None = None,
) -> Job:
    return Job(
        job_id=job_id,
        tenant_id=tenant,
        tier="t",
        rank=rank,
        weight=weight,
        prompt_token_ids=(1,) * prompt,
        params=SamplingParams(max_tokens=4),
        arrival_s=arrival_s,
        max_queue_ms=max_queue_ms,
    )


def _drain(queue, now_s: float = 0.0) -> list[str]:
    out = []
    while (job := queue.pop(now_s, "w")) is not None:
        out.append(job.job_id)
    return out


def test_fcfs_serves_arrival_order_and_priority_serves_rank_first() -> None:
    jobs = [
        _job("a", "x", rank=2, arrival_s=0),
        _job("b", "y", rank=0, arrival_s=1),
        _job("c", "x", rank=1, arrival_s=2),
        _job("d", "y", rank=0, arrival_s=3),
    ]
    fcfs, prio = FcfsQueue(), PriorityQueue()
    for job in jobs:
        fcfs.push(job, 0)
        prio.push(job, 0)
    assert fcfs.backlogged_tenants() == {"x", "y"}
    assert _drain(fcfs) == ["a", "b", "c", "d"]
    assert _drain(prio) == ["b", "d", "c", "a"]
    assert len(fcfs) == 0
    assert fcfs.backlogged_tenants() == set()


def test_queue_timeouts_are_dropped_and_reported() -> None:
    queue = FcfsQueue()
    queue.push(_job("old", "x", arrival_s=0, max_queue_ms=1000), 0)
    queue.push(_job("new", "x", arrival_s=5, max_queue_ms=1000), 5)
    assert queue.pop(5.5, "w").job_id == "new"
    assert queue.take_dropped(5.5) == ["old"]
    assert queue.take_dropped(5.5) == []


def test_vtc_shares_by_weight_and_charges_prompts_at_dispatch() -> None:
    queue = VtcQueue()
    for i in range(30):
        queue.push(_job(f"a{i}", "a", weight=1.0), 0)
        queue.push(_job(f"b{i}", "b", weight=3.0), 0)
    first = [queue.pop(0, "w").tenant_id for _ in range(20)]
    # Equal prompts, weight 3 vs 1: b gets three dispatches for each of a's.
    assert first.count("b") == 15
    assert queue.counter("a") == pytest.approx(queue.counter("b"), abs=10)
    job = queue.pop(0, "w")
    before = queue.counter(job.tenant_id)
    queue.charge(job, 5, 0)
    assert queue.counter(job.tenant_id) == pytest.approx(before + 2 * 5 / job.weight)


def test_vtc_lifts_a_returning_tenant_so_idling_banks_no_credit() -> None:
    queue = VtcQueue()
    for i in range(50):
        queue.push(_job(f"a{i}", "a"), 0)
    for _ in range(40):
        queue.pop(0, "w")
    assert queue.counter("a") == pytest.approx(400)
    for i in range(20):
        queue.push(_job(f"c{i}", "c"), 0)  # c was idle: lifted to a's counter
    assert queue.counter("c") == pytest.approx(400)
    order = [queue.pop(0, "w").tenant_id for _ in range(10)]
    assert order.count("c") == 5  # alternates instead of c monopolising the queue
