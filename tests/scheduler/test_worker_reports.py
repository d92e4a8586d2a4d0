"""worker_reports: each live worker's latest report, the same on both backends (real
Redis), as /admin/v1/queues lists it."""

from __future__ import annotations

from scheduler.backend import WorkerReport


async def test_reports_of_live_workers_by_id(backend, clock) -> None:
    assert await backend.worker_reports() == []
    await backend.publish_capacity(
        "w2",
        prefill_tokens_per_s=500.0,
        decode_tokens_per_s=50.0,
        ttl_ms=3_000,
        unprefilled_tokens_by_rank={0: 30, 2: 400},
        decode_tokens_by_rank={2: 64},
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.25,
        step_token_budget=256,
        num_preemptions=2,
        num_recomputed_tokens=0,
    )
    clock.advance(1_200)
    # A worker that reports only its rates (an older worker, or a simulated one).
    await backend.publish_capacity(
        "w1", prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, ttl_ms=3_000
    )
    clock.advance(300)
    assert await backend.worker_reports() == [
        WorkerReport("w1", 300, 1000.0, 100.0),
        WorkerReport("w2", 1_500, 500.0, 50.0, 3, 1, 0.25, {0: 30, 2: 400}, {2: 64}, 256, 2, 0),
    ]


async def test_a_report_replaces_the_previous_one_and_lapses(backend, clock) -> None:
    await backend.publish_capacity(
        "w1",
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=100.0,
        ttl_ms=3_000,
        unprefilled_tokens_by_rank={1: 10},
        num_running=4,
        kv_cache_usage=0.5,
    )
    clock.advance(1_000)
    await backend.publish_capacity(
        "w1", prefill_tokens_per_s=900.0, decode_tokens_per_s=90.0, ttl_ms=3_000, num_running=0
    )
    assert await backend.worker_reports() == [WorkerReport("w1", 0, 900.0, 90.0, 0)]
    clock.advance(3_000)  # the report's TTL: the worker no longer counts as live
    assert await backend.worker_reports() == []
    assert (await backend.fleet_capacity()).num_workers == 0
