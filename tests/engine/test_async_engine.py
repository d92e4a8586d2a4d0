"""AsyncEngine: concurrent streams, aborts free blocks, crash and shutdown surface."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from engine import FinishReason, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
LONG = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine(
        EngineConfig(device="cpu", max_num_seqs=8, max_model_len=1024, kv_cache_bytes=2**21)
    )
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, **kwargs):
    return [o async for o in engine.generate(prompt, params, **kwargs)]


async def _until(predicate, timeout_s: float = 10.0) -> None:
    # The state lives in the loop thread's stats snapshot: poll it, with a deadline.
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_concurrent_generates_stream_complete_outputs(engine: AsyncEngine) -> None:
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(6)]
    results = await asyncio.gather(
        *(_collect(engine, p, GREEDY, request_id=f"r{i}") for i, p in enumerate(prompts))
    )
    for i, outputs in enumerate(results):
        final = outputs[-1]
        assert final.finished
        assert not any(o.finished for o in outputs[:-1])
        assert final.request_id == f"r{i}"
        assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
        assert "".join(o.text_delta for o in outputs) == final.text
        assert final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    # Each stream equals the request run alone.
    alone = await _collect(engine, prompts[2], GREEDY)
    assert alone[-1].token_ids == results[2][-1].token_ids


async def test_leaving_the_stream_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    initial_free = engine.stats().num_free_blocks
    stream = engine.generate([5] * 100, LONG, request_id="leaver")
    async for output in stream:
        if output.num_output_tokens == 3:
            break
    await stream.aclose()
    await _until(lambda: engine.stats().num_running == 0)
    assert engine.stats().num_free_blocks == initial_free


async def test_cancelled_task_aborts_its_request(engine: AsyncEngine) -> None:
    initial_free = engine.stats().num_free_blocks
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate([6] * 60, LONG, request_id="cancelled"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: engine.stats().num_running == 0)
    assert engine.stats().num_free_blocks == initial_free


async def test_abort_by_id_ends_the_stream_with_abort(engine: AsyncEngine) -> None:
    outputs = []
    async for output in engine.generate([7] * 20, LONG, request_id="victim"):
        outputs.append(output)
        if len(outputs) == 2:
            engine.abort("victim")
    assert outputs[-1].finished
    assert outputs[-1].finish_reason is FinishReason.ABORT
    assert len(outputs) < 50


async def test_batched_outputs_are_the_same_outputs_in_order(engine: AsyncEngine) -> None:
    prompt = [11, 21, 31]
    single = await _collect(engine, prompt, GREEDY, request_id="one-by-one")
    batches = []
    async for batch in engine.generate_batches(prompt, GREEDY, request_id="in-lists"):
        assert batch, "a batch holds at least one output"
        batches.append(batch)
        await asyncio.sleep(0.02)  # let several steps pile up
    flat = [o for batch in batches for o in batch]
    assert len(batches) < len(flat), "outputs that arrived together came in one list"
    assert [o.new_token_ids for o in flat] == [o.new_token_ids for o in single]
    assert [o.text_delta for o in flat] == [o.text_delta for o in single]
    assert flat[-1].finished
    assert not any(o.finished for o in flat[:-1])
    with pytest.raises(InvalidRequestError):
        async for _ in engine.generate_batches([], GREEDY):
            pass


async def test_leaving_batched_outputs_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    initial_free = engine.stats().num_free_blocks
    batches = engine.generate_batches([5] * 100, LONG, request_id="batch-leaver")
    async for batch in batches:
        if batch[-1].num_output_tokens >= 3:
            break
    await batches.aclose()
    await _until(lambda: engine.stats().num_running == 0)
    assert engine.stats().num_free_blocks == initial_free


async def test_bad_input_raises_typed_errors_and_others_keep_going(engine: AsyncEngine) -> None:
    good = asyncio.create_task(_collect(engine, [1, 2, 3], GREEDY))
    with pytest.raises(InvalidRequestError):
        await _collect(engine, [], GREEDY)
    with pytest.raises(ContextLengthExceededError):
        await _collect(engine, [5] * 1000, SamplingParams(max_tokens=100))
    first = engine.generate([4, 5], LONG, request_id="dup")
    await anext(first)
    with pytest.raises(InvalidRequestError, match="already in use"):
        await _collect(engine, [4, 5], GREEDY, request_id="dup")
    await first.aclose()
    assert (await good)[-1].finished


async def test_can_accept_and_properties(engine: AsyncEngine) -> None:
    assert engine.can_accept()
    assert engine.model_name == "tiny-random"
    assert engine.max_model_len == 1024
    assert engine.tokenizer.decode(engine.tokenizer.encode("hello")) == "hello"


async def test_pending_adds_count_against_the_room_the_last_step_left() -> None:
    # Not started: adds stay pending, as they do while the loop thread is busy.
    engine = AsyncEngine(EngineConfig(device="cpu", max_num_seqs=3, kv_cache_bytes=2**21))
    try:
        streams = [engine.generate([5, 6, 7], GREEDY, request_id=f"r{i}") for i in range(3)]
        tasks = []
        for stream in streams:
            assert engine.can_accept(), "a burst is handed over up to the free slots"
            tasks.append(asyncio.create_task(anext(stream)))
            await asyncio.sleep(0)  # the add is made, and waits for the loop thread
        assert not engine.can_accept(), "three pending adds fill three slots"
        assert not engine.can_accept(rank=0)
        engine.start()
        for task in tasks:
            assert (await task).new_token_ids
        for stream in streams:
            await stream.aclose()
    finally:
        engine.shutdown()


async def test_adds_the_loop_took_count_against_the_room_until_their_step_ends() -> None:
    # Between the loop thread taking the adds and the end of the step that starts them,
    # they were neither pending nor in the room the last step left: a dispatcher asking
    # then saw every slot free and leased a second batch of jobs for this engine.
    engine = AsyncEngine(EngineConfig(device="cpu", max_num_seqs=2, kv_cache_bytes=2**21))
    real_step = engine._engine.step
    stepping, release = threading.Event(), threading.Event()

    def held_step():  # the real step, after the test has looked at the engine
        stepping.set()
        release.wait(30)
        return real_step()

    engine._engine.step = held_step
    engine.start()
    try:
        streams = [engine.generate([5, 6, 7], GREEDY, request_id=f"r{i}") for i in range(2)]
        tasks = [asyncio.create_task(anext(stream)) for stream in streams]
        await asyncio.to_thread(stepping.wait, 30)  # the loop thread took both adds
        assert not engine.can_accept(), "two adds taken fill the two slots"
        assert engine.newcomer_room()[0] == 0
        release.set()
        for task in tasks:
            assert (await task).new_token_ids
        for stream in streams:
            await stream.aclose()
    finally:
        release.set()
        engine.shutdown()


async def test_outputs_wait_for_a_busy_event_loop_and_arrive_in_order(
    engine: AsyncEngine,
) -> None:
    loop = asyncio.get_running_loop()
    wakes = 0
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        nonlocal wakes
        wakes += 1
        return call_soon_threadsafe(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        stream = engine.generate([3, 4, 5], params)
        first = await anext(stream)
        time.sleep(0.5)  # noqa: ASYNC251 (on purpose: the loop is busy while the engine runs)
        outputs = [first] + [o async for o in stream]
    finally:
        del loop.call_soon_threadsafe
    assert len(outputs) == 24
    assert outputs[-1].finished
    assert [t for o in outputs for t in o.new_token_ids] == outputs[-1].token_ids
    # The 23 outputs made while the loop was busy woke it about once, not 23 times.
    assert wakes <= 4, wakes


async def test_shutdown_stops_the_loop_and_fails_waiters() -> None:
    engine = AsyncEngine(EngineConfig(device="cpu", max_num_seqs=4, kv_cache_bytes=2**21))
    engine.start()
    stream = engine.generate([9] * 10, LONG)
    await anext(stream)
    await asyncio.to_thread(engine.shutdown)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        await _collect(engine, [1], GREEDY)
    assert not engine.can_accept()


async def test_an_engine_crash_reaches_every_waiter() -> None:
    engine = AsyncEngine(EngineConfig(device="cpu", max_num_seqs=4, kv_cache_bytes=2**21))
    engine.start()
    first = engine.generate([9] * 10, LONG)
    await anext(first)
    # Break the model for real: its forward pass now fails inside the loop thread.
    engine._engine.runner.kv_caches = []
    second = engine.generate([8] * 10, LONG)
    with pytest.raises(EngineDeadError):
        async for _ in first:
            pass
    with pytest.raises(EngineDeadError):
        async for _ in second:
            pass
    assert not engine.is_running
    engine.shutdown()
