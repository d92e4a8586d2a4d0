"""Step scheduler: continuous batching, chunked prefill, preemption, token budget.

A simulated runner executes each plan against a fake KV cache in which every slot records
which prefix it was computed for, so a chunk that reads KV it does not own (a wrong cache
hit, a block freed too early, a shared block overwritten) fails the test.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.cost_model import StepCostModel
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.request import FinishReason, Priority, Request, RequestStatus, SamplingParams
from engine.step_scheduler import ScheduledChunk, SchedulerConfig, StepPlan, StepScheduler


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    rank: int = 0,
    preemptible: bool = True,
    arrival_s: float = 0.0,
    tpot_slo_ms: float | None = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        priority=Priority(
            rank=rank, arrival_s=arrival_s, preemptible=preemptible, tpot_slo_ms=tpot_slo_ms
        ),
    )


class SimRunner:
    """Runs plans on a fake KV cache and plays the engine's part after each step."""

    def __init__(self, scheduler: StepScheduler, *, seed: int = 0, vocab: int = 4) -> None:
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.finished: list[Request] = []

    def step(self) -> StepPlan:
        decoding = {
            r.request_id
            for r in self.scheduler.running
            if not r.is_prefilling and r.num_computed_tokens < r.num_tokens
        }
        plan = self.scheduler.schedule()
        check_plan(self.scheduler, plan)
        # Decodes of running requests come first, best rank first.
        decodes = [c for c in plan.chunks if c.request.request_id in decoding]
        assert plan.chunks[: len(decodes)] == decodes
        ranks = [c.request.priority.rank for c in decodes]
        assert ranks == sorted(ranks)
        check_priority(self.scheduler, plan)
        size = self.bm.block_size
        for chunk in plan.chunks:
            request = chunk.request
            tokens = request.all_token_ids
            for pos in range(chunk.start):  # everything before the chunk must be there
                slot = (request.block_ids[pos // size], pos % size)
                assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (request.request_id, pos)
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                block_id = request.block_ids[pos // size]
                assert self.bm.ref_count(block_id) == 1, "wrote into a shared block"
                self.kv[(block_id, pos % size)] = tuple(tokens[: pos + 1])
        for chunk in plan.chunks:
            if not chunk.produces_token:
                continue
            request = chunk.request
            request.output_token_ids.append(self.rng.randrange(self.vocab))
            if request.num_output_tokens >= request.params.max_tokens:
                self.scheduler.finish(request, FinishReason.LENGTH)
                self.finished.append(request)
        check_state(self.scheduler)
        return plan

    def drain(self, max_steps: int = 5_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("requests never finished")


def check_plan(scheduler: StepScheduler, plan: StepPlan) -> None:
    config = scheduler.config
    assert plan.num_batched_tokens == sum(c.num_tokens for c in plan.chunks)
    assert plan.num_batched_tokens <= config.max_num_batched_tokens
    assert len({c.request.request_id for c in plan.chunks}) == len(plan.chunks)
    for chunk in plan.chunks:
        request = chunk.request
        assert request.status is RequestStatus.RUNNING
        assert chunk.num_tokens >= 1
        assert chunk.start + chunk.num_tokens == request.num_computed_tokens <= request.num_tokens
        assert len(request.block_ids) * scheduler.block_manager.block_size >= (
            request.num_computed_tokens
        )
        if config.enable_chunked_prefill and not chunk.is_decode:
            assert chunk.num_tokens <= config.max_prefill_chunk_tokens
    for request in plan.preempted:
        assert request not in [c.request for c in plan.chunks]


def check_state(scheduler: StepScheduler) -> None:
    """No leaks, no double frees, queues in their documented order."""
    bm = scheduler.block_manager
    live = list(scheduler.running) + list(scheduler.waiting)
    refs = Counter(b for r in live for b in r.block_ids)
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == refs[block_id], block_id
    assert bm.num_free_blocks == bm.num_blocks - len(refs)
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    for request in scheduler.waiting:
        assert request.block_ids == []
        assert request.num_computed_tokens == 0
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
    # Victims keep their place ahead of newcomers of their rank; better ranks first.
    keys = [(r.priority.rank, r.status is not RequestStatus.PREEMPTED) for r in scheduler.waiting]
    assert keys == sorted(keys)


def new_scheduler(
    *, num_blocks: int = 32, block_size: int = 4, cost_model: StepCostModel | None = None, **config
) -> StepScheduler:
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_seqs", 8)
    return StepScheduler(
        SchedulerConfig(**config), BlockManager(num_blocks, block_size), cost_model=cost_model
    )


# --------------------------------------------------------------------- validation


def test_add_rejects_bad_input_without_disturbing_others() -> None:
    scheduler = new_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    good = make_request("good", [1, 2, 3], max_tokens=3)
    scheduler.add(good)
    runner = SimRunner(scheduler)
    runner.step()
    with pytest.raises(InvalidRequestError) as empty:
        scheduler.add(make_request("empty", [], max_tokens=3))
    assert empty.value.param == "prompt"
    with pytest.raises(ContextLengthExceededError) as too_long:
        scheduler.add(make_request("long", [1] * 60, max_tokens=10))
    assert too_long.value.max_model_len == 64
    assert too_long.value.num_prompt_tokens == 60
    with pytest.raises(InvalidRequestError, match="KV cache"):
        scheduler.add(make_request("huge", [1] * 40, max_tokens=2))  # 41 > 8 blocks of 4
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add(make_request("good", [1], max_tokens=1))
    assert scheduler.stats.num_rejected == 4
    assert scheduler.num_waiting == 0
    assert [r.request_id for r in scheduler.running] == ["good"]
    runner.drain()
    assert good.finish_reason is FinishReason.LENGTH
    assert good.num_output_tokens == 3
    check_state(scheduler)


def test_request_that_fills_the_whole_cache_runs_alone() -> None:
    # 8 blocks of 4 = 32 slots; 30 + 3 tokens need 32 slots of KV (the last token none).
    scheduler = new_scheduler(num_blocks=8, block_size=4, watermark_blocks=3)
    big = make_request("big", list(range(30)), max_tokens=3)
    scheduler.add(big)
    runner = SimRunner(scheduler)
    runner.drain()
    assert big.num_output_tokens == 3
    assert scheduler.block_manager.num_free_blocks == 8


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="watermark"):
        SchedulerConfig(watermark_blocks=-1)


# --------------------------------------------------------------------- batching


def test_decodes_come_first_then_capped_prefill_chunks() -> None:
    scheduler = new_scheduler(num_blocks=64, max_num_batched_tokens=20, max_prefill_chunk_tokens=8)
    runner = SimRunner(scheduler)
    short = make_request("short", [1, 2, 3], max_tokens=10)
    scheduler.add(short)
    runner.step()  # short's prefill
    scheduler.add(make_request("long", list(range(40)), max_tokens=2))
    scheduler.add(make_request("other", list(range(50, 90)), max_tokens=2))
    plan = runner.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [
        ("short", 1),
        ("long", 8),
        ("other", 8),
    ]
    assert plan.chunks[0].is_decode
    assert not plan.chunks[1].produces_token
    plan = runner.step()
    # The running chunked prefills continue; the budget of 20 caps the last one.
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [
        ("short", 1),
        ("long", 8),
        ("other", 8),
    ]
    runner.drain()
    assert all(r.num_output_tokens == r.params.max_tokens for r in runner.finished)


def test_budget_caps_the_last_chunk() -> None:
    scheduler = new_scheduler(num_blocks=64, max_num_batched_tokens=12, max_prefill_chunk_tokens=8)
    runner = SimRunner(scheduler)
    scheduler.add(make_request("a", list(range(20)), max_tokens=2))
    scheduler.add(make_request("b", list(range(20, 40)), max_tokens=2))
    plan = runner.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 8), ("b", 4)]
    assert plan.num_batched_tokens == 12


def test_without_chunked_prefill_a_prompt_runs_in_one_chunk() -> None:
    scheduler = new_scheduler(
        num_blocks=64,
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
    )
    runner = SimRunner(scheduler)
    scheduler.add(make_request("a", list(range(40)), max_tokens=2))
    scheduler.add(make_request("b", list(range(40, 80)), max_tokens=2))
    plan = runner.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 40)]
    assert plan.chunks[0].produces_token
    plan = runner.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 40)]
    runner.drain()


def test_max_num_seqs_limits_running() -> None:
    scheduler = new_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    runner = SimRunner(scheduler)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", [i, i, i], max_tokens=3))
    plan = runner.step()
    assert [c.request.request_id for c in plan.chunks] == ["r0", "r1"]
    assert scheduler.num_waiting == 1
    assert not scheduler.can_accept()
    runner.drain()
    assert len(runner.finished) == 3


def test_newcomer_room_is_what_the_next_step_can_start() -> None:
    scheduler = new_scheduler(
        num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, watermark_blocks=2
    )
    runner = SimRunner(scheduler)
    # Empty: every slot, and the budget (14 free blocks above the watermark hold 56).
    assert scheduler.newcomer_room() == (4, 32)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", [i] * 5, max_tokens=8))
    # Newcomers waiting: no room until the step has taken them.
    assert not scheduler.can_accept()
    assert scheduler.newcomer_room() == (0, 0)
    runner.step()
    assert scheduler.num_running == 3
    assert scheduler.num_waiting == 0
    # One slot left; the budget after three decodes (8 blocks above the watermark hold 32).
    assert scheduler.newcomer_room() == (1, 29)
    scheduler.add(make_request("r3", [3] * 30, max_tokens=8))
    runner.step()
    # Full: no slot, so no room whatever the budget and the blocks.
    assert scheduler.num_running == 4
    assert scheduler.newcomer_room() == (0, 0)
    runner.drain()
    assert scheduler.newcomer_room() == (4, 32)


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    scheduler = new_scheduler(num_blocks=32, block_size=4)
    runner = SimRunner(scheduler)
    prompt = list(range(10))
    first = make_request("first", prompt, max_tokens=2)
    scheduler.add(first)
    runner.drain()
    second = make_request("second", [*prompt, 77], max_tokens=2)
    scheduler.add(second)
    plan = runner.step()
    assert second.num_cached_tokens == 8
    assert plan.chunks[0].start == 8
    assert plan.chunks[0].num_tokens == 3
    assert scheduler.block_manager.prefix_cache_stats.num_hit_tokens == 8
    runner.drain()


def test_running_requests_share_their_prefix_with_newcomers() -> None:
    scheduler = new_scheduler(num_blocks=32, block_size=4)
    runner = SimRunner(scheduler)
    prompt = list(range(12))
    first = make_request("first", prompt, max_tokens=10)
    scheduler.add(first)
    runner.step()
    runner.step()
    second = make_request("second", [*prompt, 50, 51], max_tokens=2)
    scheduler.add(second)
    plan = runner.step()
    assert first.status is RequestStatus.RUNNING
    assert second.num_cached_tokens == 12
    assert second.block_ids[:3] == first.block_ids[:3]
    assert all(scheduler.block_manager.ref_count(b) == 2 for b in first.block_ids[:3])
    assert plan.chunks[-1].start == 12
    runner.drain()


def test_worse_rank_prefill_gives_its_budget_to_a_better_newcomer() -> None:
    scheduler = new_scheduler(
        num_blocks=64, max_num_batched_tokens=16, max_prefill_chunk_tokens=16, max_model_len=128
    )
    runner = SimRunner(scheduler)
    batch = make_request("batch", list(range(100)), max_tokens=2, rank=2)
    scheduler.add(batch)
    assert runner.step().chunks[0].num_tokens == 16
    vip = make_request("vip", [7] * 10, max_tokens=2, rank=0)
    scheduler.add(vip)
    plan = runner.step()
    # The batch prefill continues with what the newcomer leaves; no KV is lost.
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("batch", 16, 6),
        ("vip", 0, 10),
    ]
    assert plan.preempted == []
    assert batch.num_preemptions == 0
    plan = runner.step()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [
        ("vip", 10, 1),
        ("batch", 22, 15),
    ]
    runner.drain()


def test_same_rank_newcomer_does_not_take_a_running_prefills_budget() -> None:
    scheduler = new_scheduler(
        num_blocks=64, max_num_batched_tokens=16, max_prefill_chunk_tokens=16, max_model_len=128
    )
    runner = SimRunner(scheduler)
    first = make_request("first", list(range(100)), max_tokens=2, rank=1)
    scheduler.add(first)
    runner.step()
    scheduler.add(make_request("second", [7] * 10, max_tokens=2, rank=1))
    plan = runner.step()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("first", 16)]


def test_schedule_copes_with_engine_not_appending() -> None:
    # A decode whose sampled token never arrived has nothing to run; it is skipped.
    scheduler = new_scheduler()
    request = make_request("r", [1, 2, 3], max_tokens=4)
    scheduler.add(request)
    scheduler.schedule()
    plan = scheduler.schedule()
    assert plan.is_empty
    scheduler.abort("r")
    check_state(scheduler)


def test_abort_frees_blocks_anywhere() -> None:
    scheduler = new_scheduler(num_blocks=16, max_num_seqs=1)
    runner = SimRunner(scheduler)
    running = make_request("running", list(range(9)), max_tokens=5)
    waiting = make_request("waiting", list(range(9)), max_tokens=5)
    scheduler.add(running)
    scheduler.add(waiting)
    runner.step()
    assert scheduler.block_manager.num_free_blocks < 16
    assert scheduler.abort("waiting") is waiting
    assert scheduler.abort("running") is running
    assert scheduler.abort("nope") is None
    assert running.finish_reason is FinishReason.ABORT
    assert running.status is RequestStatus.FINISHED
    assert scheduler.block_manager.num_free_blocks == 16
    assert not scheduler.has_unfinished()
    check_state(scheduler)


# --------------------------------------------------------------------- preemption


def fill_with_batch(scheduler: StepScheduler, runner: SimRunner, sizes: list[int]) -> list[Request]:
    batch = []
    for i, size in enumerate(sizes):
        request = make_request(f"batch{i}", [100 + i] * size, max_tokens=6, rank=2)
        scheduler.add(request)
        batch.append(request)
    runner.step()
    runner.step()
    return batch


def test_better_rank_preempts_cheapest_worse_preemptible() -> None:
    # 10 blocks of 4: after a prefill and a decode, batch requests of 11, 5 and 19
    # computed tokens hold 3 + 2 + 5 blocks, and their next decode needs no new block.
    scheduler = new_scheduler(num_blocks=10, block_size=4, watermark_blocks=0)
    runner = SimRunner(scheduler)
    batch = fill_with_batch(scheduler, runner, [10, 4, 18])
    assert scheduler.block_manager.num_free_blocks == 0
    vip = make_request("vip", [7] * 5, max_tokens=3, rank=0)
    scheduler.add(vip)
    plan = runner.step()
    # batch1 has the fewest computed tokens and frees enough (2 blocks for 5 tokens).
    assert plan.preempted == [batch[1]]
    assert batch[1].status is RequestStatus.PREEMPTED
    assert batch[1].num_computed_tokens == 0
    assert batch[1].num_preemptions == 1
    assert vip.status is RequestStatus.RUNNING
    assert plan.chunks[-1].request is vip
    assert batch[1] not in [c.request for c in plan.chunks]
    assert scheduler.stats.num_preemptions == 1
    assert scheduler.stats.num_preempted_tokens == 5
    runner.drain()
    assert batch[1].num_output_tokens == 6


def test_better_rank_waits_when_preemption_cannot_make_room() -> None:
    scheduler = new_scheduler(num_blocks=10, block_size=4, watermark_blocks=0)
    runner = SimRunner(scheduler)
    protected = make_request("protected", [5] * 30, max_tokens=3, rank=2, preemptible=False)
    scheduler.add(protected)
    runner.step()
    vip = make_request("vip", [7] * 12, max_tokens=2, rank=0)
    scheduler.add(vip)
    plan = runner.step()
    assert plan.preempted == []
    assert protected.status is RequestStatus.RUNNING
    assert scheduler.waiting == (vip,)
    runner.drain()
    assert vip.num_output_tokens == 2
    assert protected.num_preemptions == 0


def test_max_num_seqs_full_preempts_worse_rank() -> None:
    scheduler = new_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=32)
    runner = SimRunner(scheduler)
    batch = fill_with_batch(scheduler, runner, [4, 8])
    assert not scheduler.can_accept()
    assert scheduler.can_accept(rank=1)
    assert not scheduler.can_accept(rank=2)
    vip = make_request("vip", [9, 9], max_tokens=2, rank=1)
    scheduler.add(vip)
    assert not scheduler.can_accept(rank=1)
    plan = runner.step()
    assert plan.preempted == [batch[0]]
    assert vip.status is RequestStatus.RUNNING
    runner.drain()


def test_equal_rank_never_preempts() -> None:
    scheduler = new_scheduler(num_blocks=64, max_num_seqs=1)
    runner = SimRunner(scheduler)
    first = make_request("first", [1, 2], max_tokens=5, rank=1)
    scheduler.add(first)
    runner.step()
    scheduler.add(make_request("second", [3, 4], max_tokens=5, rank=1))
    plan = runner.step()
    assert plan.preempted == []
    assert [c.request for c in plan.chunks] == [first]


def test_victim_resumes_ahead_of_newcomers_of_its_rank_and_reuses_cache() -> None:
    scheduler = new_scheduler(num_blocks=64, max_num_seqs=1, block_size=4)
    runner = SimRunner(scheduler)
    victim = make_request("victim", list(range(20)), max_tokens=8, rank=2, arrival_s=5.0)
    scheduler.add(victim)
    for _ in range(4):
        runner.step()
    computed = victim.num_computed_tokens
    early = make_request("early", [1, 1], max_tokens=2, rank=2, arrival_s=0.0)
    scheduler.add(early)  # same rank, earlier arrival, but a newcomer
    vip = make_request("vip", [3, 3], max_tokens=2, rank=0, arrival_s=9.0)
    scheduler.add(vip)
    plan = runner.step()
    assert plan.preempted == [victim]
    assert [r.request_id for r in scheduler.waiting] == ["victim", "early"]
    while vip.status is not RequestStatus.FINISHED:
        runner.step()
    plan = runner.step()
    assert [c.request for c in plan.chunks] == [victim]
    # Its full blocks stayed cached: only the tail is recomputed.
    assert plan.chunks[0].start == (computed - 1) // 4 * 4
    assert scheduler.stats.num_recomputed_tokens == computed - plan.chunks[0].start
    runner.drain()
    assert early.first_scheduled_s is not None
    assert victim.num_output_tokens == 8


def test_kv_pressure_preempts_worst_rank_first() -> None:
    # Both fit at admission, but growing decodes exhaust the cache.
    scheduler = new_scheduler(num_blocks=6, block_size=4, watermark_blocks=0, max_model_len=64)
    runner = SimRunner(scheduler)
    good = make_request("good", [1] * 7, max_tokens=16, rank=0, preemptible=False)
    bad = make_request("bad", [2] * 7, max_tokens=16, rank=3, preemptible=False)
    scheduler.add(good)
    scheduler.add(bad)
    preempted: list[Request] = []
    while scheduler.has_unfinished():
        preempted += runner.step().preempted
        assert good.num_preemptions == 0
    assert preempted
    assert set(preempted) == {bad}
    assert good.num_output_tokens == bad.num_output_tokens == 16


def test_kv_pressure_preempts_worse_decode_for_better_prefill() -> None:
    # A better request mid-prefill gets blocks from a worse one that is decoding.
    scheduler = new_scheduler(
        num_blocks=8, block_size=4, watermark_blocks=0, max_prefill_chunk_tokens=4
    )
    runner = SimRunner(scheduler)
    worse = make_request("worse", [2] * 11, max_tokens=12, rank=2, preemptible=False)
    scheduler.add(worse)
    runner.step()
    runner.step()
    runner.step()
    better = make_request("better", [1] * 16, max_tokens=2, rank=0)
    scheduler.add(better)
    preempted: list[Request] = []
    while better.status is not RequestStatus.FINISHED:
        preempted += runner.step().preempted
    assert worse in preempted
    assert better.num_preemptions == 0
    runner.drain()


# --------------------------------------------------------------------- cost model


def expensive_cost_model() -> StepCostModel:
    # step_s = 5 ms + 0.1 ms per token.
    model = StepCostModel(min_samples=4)
    for tokens in (1, 10, 50, 100, 200, 400):
        model.observe(tokens, 1, 0.005 + 0.0001 * tokens)
    return model


def test_tpot_slo_shrinks_prefill_budget() -> None:
    model = expensive_cost_model()
    scheduler = new_scheduler(
        num_blocks=128,
        max_num_batched_tokens=256,
        max_prefill_chunk_tokens=256,
        max_model_len=512,
        cost_model=model,
        tpot_slo_share=1.0,
    )
    runner = SimRunner(scheduler)
    slo = make_request("slo", [1, 2, 3], max_tokens=20, tpot_slo_ms=10.0)
    scheduler.add(slo)
    runner.step()
    runner.step()  # slo is now decoding
    scheduler.add(make_request("bulk", list(range(200)), max_tokens=2, rank=2))
    plan = runner.step()
    # 10 ms allows 50 tokens in the step (49 after rounding down the fitted line).
    assert 49 <= plan.num_batched_tokens <= 50
    assert model.predict(plan.num_batched_tokens, len(plan.chunks)) <= 0.010 + 1e-9
    slo_done = False
    while scheduler.has_unfinished():
        plan = runner.step()
        slo_done = slo_done or slo.is_finished
        if not slo_done and slo.num_output_tokens > 0:
            assert plan.num_batched_tokens <= 50
    # Without a decoding SLO request the budget is whole again.
    scheduler.add(make_request("bulk2", list(range(1000, 1300)), max_tokens=2, rank=2))
    assert runner.step().num_batched_tokens == 256


def test_decodes_are_never_cut_by_the_slo() -> None:
    model = expensive_cost_model()
    scheduler = new_scheduler(
        num_blocks=256, max_num_seqs=64, max_num_batched_tokens=128, cost_model=model
    )
    runner = SimRunner(scheduler)
    for i in range(60):
        scheduler.add(make_request(f"r{i}", [i, 1], max_tokens=5, tpot_slo_ms=6.0))
    runner.step()
    scheduler.add(make_request("late", list(range(40)), max_tokens=2))
    plan = runner.step()
    assert sum(1 for c in plan.chunks if c.is_decode) == 60
    # Only the floor of the prefill budget is left for new work.
    assert plan.num_batched_tokens == 60 + scheduler.config.min_prefill_tokens
    runner.drain()


def test_throughput_decodes_yield_to_a_tpot_slo() -> None:
    model = expensive_cost_model()
    scheduler = new_scheduler(
        num_blocks=512,
        max_num_seqs=64,
        max_num_batched_tokens=128,
        cost_model=model,
        tpot_slo_share=0.8,
    )
    runner = SimRunner(scheduler)
    batch = [make_request(f"b{i}", [i, 1], max_tokens=12, rank=2) for i in range(60)]
    for request in batch:
        scheduler.add(request)
    runner.step()
    assert sum(1 for c in runner.step().chunks if c.is_decode) == 60  # no SLO: all decode
    slo = make_request("slo", [7, 7], max_tokens=6, rank=1, tpot_slo_ms=10.0)
    scheduler.add(slo)
    runner.step()  # slo's prefill
    while not slo.is_finished:
        plan = runner.step()
        decodes = [c for c in plan.chunks if c.is_decode]
        # 80 % of 10 ms holds 30 tokens: 16 of prefill floor, 14 decodes (the SLO's too).
        assert slo.is_finished or any(c.request is slo for c in decodes)
        assert len(decodes) <= 14
        assert model.predict(plan.num_batched_tokens, len(plan.chunks)) <= 0.008 + 1e-9
    assert all(r.status is RequestStatus.RUNNING for r in batch if not r.is_finished)
    plan = runner.step()  # the SLO request is gone: every batch decode is back
    assert sum(1 for c in plan.chunks if c.is_decode) == sum(not r.is_finished for r in batch)
    # An SLO tighter than any step still lets one throughput decode through.
    scheduler.add(make_request("tight", [9, 9], max_tokens=4, rank=1, tpot_slo_ms=1.0))
    runner.step()
    plan = runner.step()
    assert sum(1 for c in plan.chunks if c.is_decode) == 2
    runner.drain()
    check_state(scheduler)


# --------------------------------------------------------------------- properties

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=24)
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            prompts,
            st.integers(1, 12),
            st.integers(0, 2),
            st.booleans(),
        ),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 6),
    chunk=st.integers(1, 16),
    watermark=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_never_leak_and_always_finish(
    ops: list[tuple], num_blocks, block_size, max_num_seqs, chunk, watermark, seed
) -> None:
    scheduler = new_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, 16),
        max_prefill_chunk_tokens=chunk,
        watermark_blocks=watermark,
        max_model_len=40,
    )
    runner = SimRunner(scheduler, seed=seed)
    added: list[Request] = []
    for i, op in enumerate(ops):
        if op[0] == "add":
            _, prompt, max_tokens, rank, preemptible = op
            request = make_request(
                f"r{i}", prompt, max_tokens, rank=rank, preemptible=preemptible, arrival_s=i
            )
            try:
                scheduler.add(request)
            except InvalidRequestError:
                assert bm_blocks(scheduler, len(prompt) + max_tokens - 1) > num_blocks
                continue
            added.append(request)
        elif op[0] == "step":
            for _ in range(op[1]):
                runner.step()
        elif added:
            victim = added[op[1] % len(added)]
            was_live = not victim.is_finished
            assert (scheduler.abort(victim.request_id) is victim) == was_live
            assert victim.is_finished
        check_state(scheduler)
    runner.drain()
    assert scheduler.block_manager.num_free_blocks == num_blocks
    for request in added:
        assert request.is_finished
        if request.finish_reason is FinishReason.LENGTH:
            assert request.num_output_tokens == request.params.max_tokens


def bm_blocks(scheduler: StepScheduler, num_tokens: int) -> int:
    return scheduler.block_manager.num_blocks_for(num_tokens)


def check_priority(scheduler: StepScheduler, plan: StepPlan) -> None:
    """The head of the waiting queue is not left behind running preemptible work of a
    worse rank whose preemption would have made room for its first chunk."""
    if plan.preempted or not scheduler.waiting:
        return
    head = scheduler.waiting[0]
    bm = scheduler.block_manager
    worse = [
        r
        for r in scheduler.running
        if r.priority.preemptible and r.priority.rank > head.priority.rank
    ]
    if not worse:
        return
    remaining = scheduler.num_running - len(worse)
    if remaining >= scheduler.config.max_num_seqs:
        return
    hits = bm.find_cached_blocks(head)
    reserve = scheduler.config.watermark_blocks if remaining else 0
    config = scheduler.config
    num_remaining = head.num_tokens - len(hits) * bm.block_size
    # Prefill chunks of worse ranks would have given way to the head.
    budget = (
        config.max_num_batched_tokens
        - plan.num_batched_tokens
        + sum(
            c.num_tokens
            for c in plan.chunks
            if not c.is_decode and c.request.priority.rank > head.priority.rank
        )
    )
    if budget <= 0:
        return
    if not config.enable_chunked_prefill:
        if num_remaining > budget:
            return
        num_tokens = num_remaining
    else:
        num_tokens = min(num_remaining, config.max_prefill_chunk_tokens, budget)
    needed = bm.num_blocks_to_allocate(head, num_tokens, hits, released=worse)
    assert needed > bm.num_free_blocks_after_release(worse) - reserve, head.request_id


def test_chunk_produces_token_is_fixed_at_schedule_time() -> None:
    request = make_request("r", [1, 2, 3])
    chunk = ScheduledChunk(request, 0, 3)
    assert chunk.produces_token
    request.output_token_ids.append(5)
    assert chunk.produces_token
    assert not ScheduledChunk(request, 0, 3).produces_token
