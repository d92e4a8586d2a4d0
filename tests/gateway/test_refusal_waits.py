"""The Retry-After of the 429s that wait for running work: `concurrency_limit_exceeded`
(one of the tenant's own requests must end) and `queue_full` (a queued job must leave
for a sequence slot). Both told the fleet's time for one request like the refused one
before, a few milliseconds for a short request while seconds of work stood ahead: a
client that honoured it retried dozens of times a second.

The concurrency case runs the real engine (tiny model) behind a real dispatcher and the
gateway's Admission; the queue_full case reads a fleet report published to the queue.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from engine.request import SamplingParams
from gateway.admission import Admission
from gateway.auth import Principal
from gateway.concurrency_wait import FleetReleases, slot_job_id
from gateway.errors import RateLimitedError
from gateway.tiers import TierPolicy
from scheduler.dispatcher import Dispatcher
from scheduler.job import Job
from scheduler.keys import KeySpace
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig
from scheduler.rate_limit import MemoryRateLimiter, RedisRateLimiter, TenantLimits
from scheduler.redis_backend import RedisBackend
from scheduler.results import JobClient
from tests.conftest import REDIS_URL
from tests.scheduler.conftest import FakeClock

CAP = 2


def _tier(name: str, rank: int, max_queued_jobs: int | None = None) -> TierPolicy:
    return TierPolicy(
        name, rank, None, None, None, max_queued_jobs, None, 0.0, False, None, None, None, 0, 0
    )


def _principal(tier: TierPolicy, max_concurrency: int | None = None) -> Principal:
    return Principal(
        "ten_a", "a", "key_a", tier, 1.0, rpm=None, tpm=None, max_concurrency=max_concurrency
    )


def _job(tier: TierPolicy, max_tokens: int, **params: object) -> Job:
    return Job(
        job_id=f"req_{uuid.uuid4().hex}",
        tenant_id="ten_a",
        tier=tier.name,
        rank=tier.rank,
        weight=1.0,
        prompt_token_ids=(5, 6, 7, 8),
        params=SamplingParams(max_tokens=max_tokens, temperature=0, **params),  # type: ignore[arg-type]
        arrival_s=time.time(),
    )


@pytest.fixture(scope="module")
def engine():
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    eng = AsyncEngine(EngineConfig(model="tiny-random", device="cpu", max_model_len=512))
    eng.start()
    yield eng
    eng.shutdown()


async def _told_and_real_wait_s(
    running_through: Admission, refused_by: Admission, tier: TierPolicy
) -> tuple[float, float]:
    """A tenant with one slot runs a 300-token request through `running_through`; once
    it is well under way, `refused_by` refuses the tenant's next one. The wait that
    refusal told, and the time the running request really took to end."""
    principal = _principal(tier, max_concurrency=1)
    long_job = _job(tier, 300, ignore_eos=True)  # runs to its 300 tokens
    reservation = await running_through.reserve(principal, long_job)
    outputs = aiter(await running_through.enqueue(long_job, tier))
    while (await anext(outputs)).num_output_tokens < 60:  # well under way
        pass
    with pytest.raises(RateLimitedError) as refused:
        await refused_by.reserve(principal, _job(tier, 4))
    told_at = time.monotonic()
    assert refused.value.code == "concurrency_limit_exceeded"
    async for _ in outputs:
        pass
    real_s = time.monotonic() - told_at
    running_through.release_soon(reservation, 300)
    told_s = refused.value.retry_after_s
    assert told_s is not None
    return told_s, real_s


async def test_the_concurrency_wait_is_when_the_tenants_running_request_ends(engine) -> None:
    tier = _tier("interactive", 1)
    backend = MemoryBackend([TierConfig(tier.name, tier.rank)])
    dispatcher = Dispatcher(backend, engine)
    admission = Admission(MemoryRateLimiter(), JobClient(backend, on_enqueue=dispatcher.notify))
    dispatcher.start()
    await dispatcher.publish_capacity()  # a live worker, before the first request
    try:
        told_s, real_s = await _told_and_real_wait_s(admission, admission, tier)
        # Before: about the time of one 4-token request, under a hundredth of this wait.
        assert 0.33 * real_s <= told_s <= 3.0 * real_s, (told_s, real_s)
    finally:
        await dispatcher.aclose(0)
        await admission.aclose()


async def test_the_concurrency_wait_counts_requests_streaming_through_another_gateway(
    engine, redis_prefix: str
) -> None:
    """Two gateways share the queue and the limits: the tenant's running request streams
    through the first, and the second, which refuses its next one, tells the wait from
    the request's progress in the queue (its own fallback, the time of one 4-token
    request, was 12 ms against 2 s)."""
    tier = _tier("interactive", 1)
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    keys = KeySpace(redis_prefix)
    backend = RedisBackend(client, keys=keys)
    await backend.configure_tiers([TierConfig(tier.name, tier.rank)])
    limiter = RedisRateLimiter(client, keys=keys)
    dispatcher = Dispatcher(backend, engine)
    here = Admission(limiter, JobClient(backend, on_enqueue=dispatcher.notify))
    jobs_elsewhere = JobClient(backend)
    elsewhere = Admission(limiter, jobs_elsewhere)
    dispatcher.start()
    await dispatcher.publish_capacity()
    try:
        told_s, real_s = await _told_and_real_wait_s(here, elsewhere, tier)
        assert 0.33 * real_s <= told_s <= 3.0 * real_s, (told_s, real_s)
    finally:
        await dispatcher.aclose(0)
        await here.aclose()
        await elsewhere.aclose()
        await jobs_elsewhere.aclose()
        await backend.aclose()


async def test_each_held_slot_frees_as_its_job_stands() -> None:
    """A running job at its pace, a queued one after the fleet's next slot release and
    its run, an ended one whose slot is still held (its gateway died) at the lapse."""
    clock = FakeClock()
    tier = _tier("interactive", 1)
    backend = MemoryBackend([TierConfig(tier.name, tier.rank)], clock_ms=clock)
    limiter = MemoryRateLimiter(clock_ms=clock)
    await backend.publish_capacity("w1", **REPORT, release_ms=[2000.0])
    limits = TenantLimits(max_concurrency=3)
    for request_id, hold_ms in (("r1", 30_000), ("r2", 30_000), ("r3", 7_000)):
        await limiter.reserve("ten_a", limits, 10, reservation_id=request_id, hold_ms=hold_ms)
    jobs = {i: replace(_job(tier, m), job_id=i) for i, m in (("r3", 4), ("r1", 50), ("r2", 40))}
    for job_id in ("r3", "r1", "r2"):
        await backend.enqueue(jobs[job_id])
    await backend.dispatch_many("w1", 60_000, 2)  # r3 and r1 run, r2 waits
    await backend.complete("r3", worker_id="w1")  # its slot is held on: nobody released it
    pace = 0.1
    releases = FleetReleases(
        limiter,
        backend,
        stop_curve=lambda: None,
        fallback_pace_s=lambda: None,
        service_s=_no_service_s,
        fleet_capacity=backend.fleet_capacity,
        clock_ms=clock,
    )
    for step in range(20):  # r1 streams 20 of its 50 tokens, one every 0.1 s
        # The lease's queue wait goes with its first step only, as a worker sends it.
        await backend.publish_step("r1", "w1", [7], queue_wait_ms=None if step else 1.0)
        clock.advance(int(pace * 1000))
    clock.advance(-int(pace * 1000))  # now is its last token
    # 1.9 s after the reservations and the report: r1 has 30 tokens left at 0.1 s (its
    # pace over 19 steps); r2 waits for the release the report expected in 2 s, then
    # runs its 40 tokens; r3's hold lapses 7 s after it was taken.
    expected = [30 * pace, 2.0 - 1.9 + 40 * pace, 7.0 - 1.9]
    for num_slots, seconds in enumerate(expected, start=1):
        assert await releases.release_s("ten_a", num_slots) == pytest.approx(seconds)
    # Asked for more than it holds: when every one has freed.
    assert await releases.release_s("ten_a", 5) == pytest.approx(expected[-1])


async def test_a_job_resumed_after_its_worker_died_frees_at_its_new_workers_pace() -> None:
    """The tenant's running request lost its worker after 20 tokens; its lease lapsed
    and another worker resumed it 10 s later. It frees at the pace it goes at now: with
    the seconds its stream stood still counted in, the wait told was 59.6 s where the
    request ended 12.9 s later."""
    clock = FakeClock()
    tier = _tier("interactive", 1)
    backend = MemoryBackend([TierConfig(tier.name, tier.rank)], clock_ms=clock)
    limiter = MemoryRateLimiter(clock_ms=clock)
    await limiter.reserve("ten_a", TenantLimits(max_concurrency=1), 10, reservation_id="r1")
    await backend.enqueue(replace(_job(tier, 200), job_id="r1"))
    releases = FleetReleases(
        limiter,
        backend,
        stop_curve=lambda: None,
        fallback_pace_s=lambda: None,
        service_s=_no_service_s,
        fleet_capacity=backend.fleet_capacity,
        clock_ms=clock,
        cache_s=0.0,
    )
    pace = 0.1
    for worker_id in ("w-dies", "w-resumes"):
        await backend.dispatch(worker_id, 5_000)
        for step in range(20):  # 20 tokens, one every 0.1 s
            wait = None if step else 1.0  # the lease's queue wait, on its first step
            await backend.publish_step("r1", worker_id, [7], queue_wait_ms=wait)
            clock.advance(int(pace * 1000))
        if worker_id == "w-dies":
            clock.advance(10_000)  # its lease lapses
            assert await backend.reclaim_expired_leases() == ["r1"]
    clock.advance(-int(pace * 1000))  # now is its last token
    # 160 tokens left at 0.1 s (its pace over the new run's 19 steps).
    assert await releases.release_s("ten_a", 1) == pytest.approx(160 * pace)


async def test_no_pace_from_a_stream_that_has_only_begun() -> None:
    clock = FakeClock()
    tier = _tier("interactive", 1)
    backend = MemoryBackend([TierConfig(tier.name, tier.rank)], clock_ms=clock)
    limiter = MemoryRateLimiter(clock_ms=clock)
    await limiter.reserve("ten_a", TenantLimits(max_concurrency=1), 10, reservation_id="r1")
    await backend.enqueue(replace(_job(tier, 600), job_id="r1"))
    await backend.dispatch("w1", 60_000)
    for step in range(3):  # three tokens, slow behind prefills: no pace to go by yet
        await backend.publish_step("r1", "w1", [7], queue_wait_ms=None if step else 1.0)
        clock.advance(500)
    paces = iter([0.05, None, None])
    services = iter([None, 12.0])

    async def service_s(num_tokens: int) -> float | None:
        assert num_tokens == 597
        return next(services)

    releases = FleetReleases(
        limiter,
        backend,
        stop_curve=lambda: None,
        fallback_pace_s=lambda: next(paces),  # this gateway's other streams', if any
        service_s=service_s,  # the fleet's time for that many tokens, if it reports
        fleet_capacity=backend.fleet_capacity,
        clock_ms=clock,
        cache_s=0.0,
    )
    assert await releases.release_s("ten_a", 1) == pytest.approx(597 * 0.05)
    assert await releases.release_s("ten_a", 1) is None
    assert await releases.release_s("ten_a", 1) == pytest.approx(12.0)


async def _no_service_s(num_tokens: int) -> float | None:
    raise AssertionError("a pace was known")


async def test_a_queued_request_holding_the_slot_waits_for_a_slot_then_runs() -> None:
    """The tenant's one request is queued behind a full fleet, whose engines give each of
    their two sequences a token every 2/260 s: it frees the slot after the fleet's next
    release and its own 600 tokens at that pace (told 10 ms before: the time of the
    refused request, or the fleet's speed for the queued one's tokens)."""
    tier = _tier("interactive", 1)
    backend = MemoryBackend([TierConfig(tier.name, tier.rank)])
    admission = Admission(MemoryRateLimiter(), JobClient(backend), capacity_max_age_ms=0)
    principal = _principal(tier, max_concurrency=1)
    await backend.publish_capacity(
        "w1",
        prefill_tokens_per_s=5_000.0,
        decode_tokens_per_s=260.0,
        ttl_ms=60_000,
        release_ms=[1_000.0],
        num_running=2,
    )
    queued = _job(tier, 600, ignore_eos=True)
    try:
        await admission.reserve(principal, queued)
        await admission.enqueue(queued, tier)  # nothing dispatches it
        with pytest.raises(RateLimitedError) as refused:
            await admission.reserve(principal, _job(tier, 1))
        assert refused.value.retry_after_s == pytest.approx(1.0 + 600 * 2 / 260, rel=0.02)
    finally:
        await admission.aclose()


def test_a_slot_names_the_job_of_its_choice() -> None:
    assert slot_job_id("chatcmpl-9a") == "chatcmpl-9a"
    assert slot_job_id("chatcmpl-9a#3") == "chatcmpl-9a.3"


async def test_the_client_learns_how_finished_requests_stopped() -> None:
    """A request that may stop early is expected to end as the ones that finished here
    did, not at its max_tokens."""
    client = JobClient(MemoryBackend())
    tier = _tier("interactive", 1)
    assert not client.stop_hazard.curve.is_measured
    for _ in range(40):  # ended by a stop after 20 tokens
        stream = client._open(_job(tier, 1000))
        stream.num_output_tokens = 20
        client._learn_stop(stream, "stop")
        client._streams.pop(stream.job.job_id)
    curve = client.stop_hazard.curve
    assert curve.is_measured
    # A new request with 1,000 tokens allowed is expected to make about 20, not 1,000.
    assert curve.expected_tokens_left(0, 1000) < 100
    # A request ended by its length says nothing of stops; one that cannot stop early
    # (ignore_eos) is not counted at all.
    before = client.stop_hazard.per_token
    ignored = client._open(_job(tier, 10, ignore_eos=True))
    ignored.num_output_tokens = 10
    client._learn_stop(ignored, "length")
    assert client.stop_hazard.per_token == before


REPORT = {"prefill_tokens_per_s": 5_000.0, "decode_tokens_per_s": 500.0, "ttl_ms": 60_000}


async def _full_queue(backend: MemoryBackend, tier: TierPolicy) -> Admission:
    # Capacity read afresh at each request: the test publishes new reports in between.
    admission = Admission(MemoryRateLimiter(), JobClient(backend), capacity_max_age_ms=0)
    await backend.publish_capacity("w1", **REPORT, num_free_seqs=1)  # nothing takes them
    for _ in range(CAP):
        await admission.enqueue(_job(tier, 4), tier)
    return admission


async def test_a_full_queue_waits_for_the_fleets_next_slot_release() -> None:
    tier = _tier("bulk", 2, max_queued_jobs=CAP)
    backend = MemoryBackend([TierConfig(tier.name, tier.rank, max_queued_jobs=CAP)])
    admission = await _full_queue(backend, tier)
    try:
        # Every slot is taken; one request of a better rank waits in an engine for one:
        # it takes the first release, the queue's head the second.
        await backend.publish_capacity(
            "w1", **REPORT, release_ms=[1_500.0, 4_000.0, 9_000.0], waiting_by_rank={1: 1}
        )
        with pytest.raises(RateLimitedError) as refused:
            await admission.enqueue(_job(tier, 4), tier)
        assert refused.value.code == "queue_full"
        assert refused.value.retry_after_s == pytest.approx(4.0, abs=0.2)
        # A free slot: the head leaves at once, in about one short job's time.
        await backend.publish_capacity("w1", **REPORT, num_free_seqs=1, release_ms=[4_000.0])
        with pytest.raises(RateLimitedError) as refused:
            await admission.enqueue(_job(tier, 4), tier)
        assert refused.value.retry_after_s is not None
        assert 0 < refused.value.retry_after_s < 0.2
    finally:
        await admission.aclose()
