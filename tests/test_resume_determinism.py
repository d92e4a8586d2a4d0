"""Seeded output across interruptions, on the real engine (tiny-random on the CPU).

A seeded request's tokens, text and log-probability count are the same whether it ran
alone, was preempted and recomputed, resumed from streamed tokens, or had its lease come
back to the worker still running it (a lapsed lease that another worker's heartbeat
reclaimed, and which this worker then leased again).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import replace

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Priority, SamplingParams
from scheduler.backend import EventKind
from scheduler.dispatcher import Dispatcher, DispatcherConfig
from scheduler.job import Job
from scheduler.logprobs import decode_logprobs
from scheduler.memory_backend import MemoryBackend
from scheduler.policy import TierConfig

TIERS = [TierConfig("rank0", rank=0), TierConfig("rank2", rank=2)]
PROMPT = (17, 240, 33, 501, 12, 9, 88, 4)
SEEDED = SamplingParams(
    max_tokens=120,
    temperature=1.2,
    top_p=0.9,
    seed=7,
    presence_penalty=0.8,
    frequency_penalty=0.4,
    logit_bias=((5, 3.0), (9, -100.0)),
    ignore_eos=True,
    logprobs=1,
)
# No heartbeat during a test: the lease comes back to the worker through the leasing
# loop alone, while the first run still goes on.
NO_HEARTBEAT = DispatcherConfig(lease_ms=120_000, heartbeat_ms=60_000, capacity_ttl_ms=120_000)
# A heartbeat every 50 ms finds a reclaimed lease lost and stops the job's run.
FAST_HEARTBEAT = DispatcherConfig(lease_ms=400, heartbeat_ms=50, capacity_ttl_ms=1_000)


def _config(**overrides) -> EngineConfig:
    return EngineConfig(model="tiny-random", device="cpu", max_model_len=256, **overrides)


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], str]:
    """SEEDED's tokens and text, run alone on an engine of its own."""
    engine = LLMEngine(_config())
    engine.add_request("alone", list(PROMPT), SEEDED)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs[-1].token_ids, outputs[-1].text


@pytest.fixture
def engine():
    eng = AsyncEngine(_config(max_num_seqs=4))
    eng.start()
    yield eng
    eng.shutdown()


def _job(job_id: str) -> Job:
    return Job(
        job_id=job_id,
        tenant_id="t",
        tier="rank2",
        rank=2,
        weight=1.0,
        prompt_token_ids=PROMPT,
        params=SEEDED,
        arrival_s=time.time(),
        preemptible=True,
    )


async def _events(backend: MemoryBackend, job_id: str, on_tokens=None) -> list:
    """The job's result events up to its end; `on_tokens(n)` after each tokens event."""
    events, num_tokens = [], 0
    async for event in backend.results(job_id, poll_ms=50):
        events.append(event)
        num_tokens += len(event.token_ids)
        if event.token_ids and on_tokens is not None:
            await on_tokens(num_tokens)
        if event.is_terminal:
            return events
    return events


def _check(events: list, reference: tuple[list[int], str]) -> None:
    tokens, text = reference
    assert events[-1].kind is EventKind.DONE, events[-1]
    assert [t for e in events for t in e.token_ids] == tokens  # no duplicate, no gap
    assert "".join(e.text for e in events) == text
    assert sum(len(decode_logprobs(e.logprobs)[0]) for e in events) == len(tokens)


async def _reclaim_everything(backend: MemoryBackend) -> list[str]:
    # Another worker's heartbeat with its clock a lease ahead: every lease has lapsed.
    return await backend.reclaim_expired_leases(now_ms=int(time.time() * 1000) + 600_000)


async def test_a_lease_back_on_its_own_worker_mid_run_finishes_once(engine, reference) -> None:
    """The lease lapses and this worker leases the job again while its run goes on: the
    run continues (before: a second run was refused as a duplicate id and the job failed
    with invalid_request; one that started would have repeated the tokens the first run
    published after the lease)."""
    backend = MemoryBackend(TIERS)
    await backend.enqueue(_job("again"))
    gated = _Gated(engine)
    dispatcher = Dispatcher(backend, gated, worker_id="w", config=NO_HEARTBEAT)
    reclaimed: list[str] = []

    async def lease_again_at_10(num_tokens: int) -> None:
        if num_tokens < 10 or reclaimed:
            return
        gated.flowing.clear()  # the run publishes nothing until the lease is back
        reclaimed.extend(await _reclaim_everything(backend))
        await _until(lambda: dispatcher.num_dispatched == 2)
        gated.flowing.set()

    dispatcher.start()
    try:
        events = await asyncio.wait_for(_events(backend, "again", lease_again_at_10), 30)
    finally:
        gated.flowing.set()
        await dispatcher.aclose(0)
    assert reclaimed == ["again"]
    _check(events, reference)


async def _until(condition) -> None:
    for _ in range(300):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the dispatcher did not get there in 3 s")


class _Gated:
    """The real AsyncEngine, taking no new work while `closed` is set (a worker whose
    engine is full), and handing out no output while `flowing` is clear (a worker
    stalled mid-run), so that the test decides what happens first."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.closed = False
        self.flowing = asyncio.Event()
        self.flowing.set()

    def can_accept(self, rank=None) -> bool:
        return not self.closed and self._engine.can_accept(rank)

    def newcomer_room(self) -> tuple[int, int]:
        return self._engine.newcomer_room()

    def stats(self):
        return self._engine.stats()

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    async def generate_batches(self, *args, **kwargs):
        async with contextlib.aclosing(self._engine.generate_batches(*args, **kwargs)) as batches:
            async for batch in batches:
                await self.flowing.wait()
                yield batch

    def generate(self, *args, **kwargs):
        return self._engine.generate(*args, **kwargs)


def _hold_steps(engine: AsyncEngine) -> threading.Event:
    """Make the engine's loop thread wait inside its next step until the returned event
    is set: it applies commands (the abort of a stopped run) only between steps."""
    release = threading.Event()
    llm = engine._engine
    step = llm.step

    def held_step():
        release.wait(30)
        return step()

    llm.step = held_step
    return release


async def test_a_job_back_right_after_its_run_here_stopped_runs_again(engine, reference) -> None:
    """The heartbeat finds the lease lost and stops the run; the job comes back to this
    worker before the engine has dropped the stopped request (it does so between two
    steps). The new run must not collide with it (before: 'request id ... is already in
    use', and the job failed with invalid_request)."""
    backend = MemoryBackend(TIERS)
    await backend.enqueue(_job("back"))
    gated = _Gated(engine)
    dispatcher = Dispatcher(backend, gated, worker_id="w", config=FAST_HEARTBEAT)
    release = None

    async def lose_the_lease_at_10(num_tokens: int) -> None:
        nonlocal release
        if num_tokens < 10 or release is not None:
            return
        gated.closed = True
        release = _hold_steps(engine)
        assert await _reclaim_everything(backend) == ["back"]
        await _until(lambda: dispatcher.num_running == 0)  # the heartbeat stopped the run
        gated.closed = False
        # Leased again while the engine still holds the stopped run.
        await _until(lambda: dispatcher.num_dispatched == 2)
        await asyncio.sleep(0.05)  # the new run reaches the engine
        release.set()

    dispatcher.start()
    try:
        events = await asyncio.wait_for(_events(backend, "back", lose_the_lease_at_10), 30)
    finally:
        if release is not None:
            release.set()
        await dispatcher.aclose(0)
    assert dispatcher.num_dispatched == 2
    _check(events, reference)


def test_seeded_output_survives_preemption_and_resume(reference) -> None:
    """Preempted many times under KV pressure and by better-rank arrivals, then resumed
    on another engine from a cut point: the same tokens and text as alone."""
    tokens, text = reference
    engine = LLMEngine(_config(kv_cache_bytes=12 * 16 * 2048, max_num_seqs=4))
    engine.add_request("seeded", list(PROMPT), SEEDED, Priority(rank=2, arrival_s=0.0))
    for i in range(2):  # batch work competing for the blocks
        engine.add_request(
            f"load{i}",
            [(31 * i + k) % 800 + 3 for k in range(40)],
            SamplingParams(max_tokens=60, temperature=1.0, ignore_eos=True),
            Priority(rank=2, arrival_s=1.0 + i),
        )
    outputs, num_steps = [], 0
    while engine.has_unfinished():
        if num_steps % 15 == 5:  # a better rank arrives now and then
            engine.add_request(
                f"urgent{num_steps}",
                [(7 * num_steps + k) % 800 + 3 for k in range(30)],
                SamplingParams(max_tokens=4),
                Priority(rank=0, arrival_s=100.0 + num_steps, preemptible=False),
            )
        outputs += [o for o in engine.step() if o.request_id == "seeded"]
        num_steps += 1
    assert engine.stats().num_preemptions >= 3
    assert outputs[-1].token_ids == tokens
    assert outputs[-1].text == text
    assert len(outputs[-1].logprobs) == len(tokens)
    cut = 57
    sent = "".join(o.text_delta for o in outputs[:cut])
    other = LLMEngine(_config())
    other.add_request("resumed", list(PROMPT), SEEDED, resumed_token_ids=tokens[:cut])
    resumed = []
    while other.has_unfinished():
        resumed += other.step()
    assert resumed[-1].token_ids == tokens
    assert sent + "".join(o.text_delta for o in resumed) == text
    assert len(resumed[-1].logprobs) == len(tokens) - cut


async def test_the_prompts_logprobs_go_out_once_across_leases(engine) -> None:
    """They travel with a job's first token: a lease that resumes after streamed tokens
    (here: the first worker drained away mid-run) does not send them again."""
    backend = MemoryBackend(TIERS)
    await backend.enqueue(replace(_job("moved"), params=replace(SEEDED, prompt_logprobs=1)))
    other_engine = AsyncEngine(_config(max_num_seqs=4))  # the other worker's
    other_engine.start()
    first = Dispatcher(backend, engine, worker_id="w1", config=NO_HEARTBEAT)
    second = Dispatcher(backend, other_engine, worker_id="w2", config=NO_HEARTBEAT)

    async def move_at_10(num_tokens: int) -> None:
        if num_tokens >= 10 and first.is_running:
            await first.aclose(0)  # hands the job back; the other worker resumes it
            second.start()

    first.start()
    try:
        events = await asyncio.wait_for(_events(backend, "moved", move_at_10), 30)
    finally:
        await first.aclose(0)
        await second.aclose(0)
        other_engine.shutdown()
    assert events[-1].kind is EventKind.DONE
    assert second.num_dispatched == 1
    sent = [p for e in events if (p := decode_logprobs(e.logprobs)[1]) is not None]
    assert len(sent) == 1
    assert [lp.token_id for lp in sent[0]] == list(PROMPT[1:])
