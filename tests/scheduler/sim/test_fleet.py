"""The event loop over the real step scheduler and the real (or a baseline) queue."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.errors import ContextLengthExceededError
from engine.request import FinishReason
from scheduler.sim.cost_model import load_preset
from scheduler.sim.engine import EngineMode, SimEngine
from scheduler.sim.fleet import POLICIES, FleetSpec, SimOptions, SimulationError, simulate
from scheduler.sim.workload import (
    LengthDist,
    TenantSpec,
    TierSpec,
    WorkloadSpec,
    three_tier_mix,
)

H200 = load_preset("h200-llama-3.1-8b")


@pytest.mark.parametrize("policy", POLICIES)
def test_light_load_finishes_everything_within_slo(policy: str) -> None:
    result = simulate(three_tier_mix(4, 10, seed=3), policy, FleetSpec(H200, 1))
    stats = result.stats
    for tier in stats.tiers.values():
        assert tier.num_offered > 0
        assert tier.num_finished == tier.num_offered
        assert tier.attainment == 1.0
        assert tier.num_unfinished == 0
        # An idle H200 answers within a few steps and decodes at ~7-9 ms a token.
        assert tier.ttft_p50_ms < 100
        assert 5 < tier.tpot_p50_ms < 15
    assert stats.num_preemptions == 0
    assert stats.output_tokens_per_s > 0


def test_single_request_timing_matches_the_cost_model() -> None:
    tier = TierSpec(
        "t", 0, prompt_len=LengthDist("fixed", mean=100), output_len=LengthDist("fixed", mean=50)
    )
    spec = WorkloadSpec((tier,), (TenantSpec("a", "t"),), rate_per_s=0.2, duration_s=8, seed=1)
    result = simulate(spec, "fcfs", FleetSpec(H200, 1), SimOptions(keep_records=True))
    record = result.collector.records[0]
    # One prefill step of 100 tokens, then 49 decode steps.
    prefill_s = H200.step_time_s(100, 100, 100 * 101 / 2)
    assert record.ttft_s == pytest.approx(prefill_s)
    decode_s = sum(H200.step_time_s(1, 101 + i, 101 + i) for i in range(49))
    assert record.finish_s - record.first_token_s == pytest.approx(decode_s)
    assert result.stats.num_steps == 50


def test_fast_forward_keeps_the_numbers_of_requests_that_stop_early() -> None:
    # Clients asking 2,048 tokens stop at their drawn lengths, inside decode runs too. A
    # run teaches the stop curve its tokens at once, where steps one by one decay the
    # earlier ones a little: admission may decide a borderline request differently.
    spec = three_tier_mix(40, 10, seed=2, max_tokens=2048)
    runs = [
        simulate(spec, "tiered", FleetSpec(H200, 1), SimOptions(keep_records=True, fast_forward=ff))
        for ff in (False, True)
    ]
    exact, fast = ({r.request.request_id: r for r in run.collector.records} for run in runs)
    assert exact.keys() == fast.keys()
    same = [i for i, r in exact.items() if r.rejected_code == fast[i].rejected_code]
    assert len(same) >= 0.98 * len(exact)
    for stats in (runs[0].stats, runs[1].stats):
        assert stats.tiers["interactive"].rejections.get("slo_unattainable", 0) > 0
    for tier in ("priority", "interactive"):
        a, b = runs[0].stats.tiers[tier], runs[1].stats.tiers[tier]
        assert b.admitted_attainment == pytest.approx(a.admitted_attainment, abs=0.02)
        assert b.ttft_p50_ms == pytest.approx(a.ttft_p50_ms, rel=0.1)
    assert runs[1].stats.output_tokens_per_s == pytest.approx(
        runs[0].stats.output_tokens_per_s, rel=0.02
    )


def test_requests_asking_more_than_they_use_stop_early_and_teach_the_stop_curve() -> None:
    clock = [0.0]
    engine = SimEngine("e0", H200, EngineMode(), clock)
    # Three rounds of chats asking 64 tokens: three stop early, one uses all 64; and a
    # request that asks exactly its length (ignore_eos), which teaches nothing.
    lengths = [5, 40, 17, 64] * 3

    def add(request_id: str, length: int, max_tokens: int | None):
        return engine.add(
            request_id,
            num_prompt_tokens=32,
            num_output_tokens=length,
            max_tokens=max_tokens,
            rank=1,
            tenant="t",
            arrival_s=0.0,
            ttft_slo_ms=None,
            tpot_slo_ms=None,
            preemptible=False,
        )

    for i, length in enumerate(lengths):
        add(f"chat-{i}", length, 64)
    exact = add("exact", 30, None)
    assert exact.params.ignore_eos
    assert not exact.may_stop
    ended = {}
    while (duration := engine.start_step()) is not None:
        clock[0] += duration
        for request in engine.end_step().finished:
            ended[request.request_id] = (len(request.output_token_ids), request.finish_reason)
    assert ended["exact"] == (30, FinishReason.LENGTH)
    for i, length in enumerate(lengths):
        reason = FinishReason.LENGTH if length == 64 else FinishReason.STOP
        assert ended[f"chat-{i}"] == (length, reason)
    # As the real engine measures it: stops per token of the requests that may stop.
    assert engine.stop_hazard.per_token == pytest.approx(9 / sum(lengths), rel=0.01)
    assert engine.stop_curve.is_measured


@pytest.mark.slow
def test_overload_conserves_requests_and_tiered_protects_the_priority_tier() -> None:
    # Sixteen sequence slots make the engine saturate at a dozen requests per second.
    params = replace(H200, max_num_seqs=16, max_num_batched_tokens=2048)
    spec = three_tier_mix(12, 20, seed=5)
    results = {
        p: simulate(spec, p, FleetSpec(params, 1), SimOptions(drain_s=30))
        for p in ("fcfs", "tiered")
    }
    for result in results.values():
        for tier in result.stats.tiers.values():
            # Refused at admission, or admitted and then finished, dropped or unfinished.
            assert tier.num_offered == tier.num_admitted + sum(tier.rejections.values())
            dropped = sum(tier.dropped.values())
            assert tier.num_finished + dropped + tier.num_unfinished == tier.num_admitted
    fcfs, tiered = (results[p].stats.tiers for p in ("fcfs", "tiered"))
    assert fcfs["priority"].attainment < 0.5
    assert tiered["priority"].attainment > 0.95
    assert tiered["interactive"].attainment > fcfs["interactive"].attainment
    assert tiered["priority"].ttft_p99_ms < fcfs["priority"].ttft_p99_ms


def test_unknown_policy_and_empty_fleet_raise() -> None:
    with pytest.raises(SimulationError, match="unknown policy"):
        simulate(three_tier_mix(1, 1), "lottery", FleetSpec(H200, 1))
    with pytest.raises(SimulationError, match="at least one engine"):
        FleetSpec(H200, 0)


@pytest.mark.parametrize(
    ("policy", "rate", "num_kv_blocks"),
    [("tiered", 40, 3000), ("priority", 30, H200.num_kv_blocks)],
)
def test_fast_forward_changes_nothing_on_one_engine(
    policy: str, rate: float, num_kv_blocks: int
) -> None:
    # 3000 blocks puts the KV cache under pressure: runs must stop short of preemption.
    params = replace(H200, num_kv_blocks=num_kv_blocks)
    spec = three_tier_mix(rate, 10, seed=2)
    runs = [
        simulate(spec, policy, FleetSpec(params, 1), SimOptions(keep_records=True, fast_forward=ff))
        for ff in (False, True)
    ]
    exact, fast = ({r.request.request_id: r for r in run.collector.records} for run in runs)
    assert exact.keys() == fast.keys()
    for request_id, record in exact.items():
        other = fast[request_id]
        assert other.rejected_code == record.rejected_code
        assert other.first_token_s == pytest.approx(record.first_token_s, abs=1e-9)
        assert other.finish_s == pytest.approx(record.finish_s, abs=1e-9)
        assert other.num_preemptions == record.num_preemptions
    assert runs[0].stats.num_steps == runs[1].stats.num_steps
    assert runs[0].stats.num_preemptions == runs[1].stats.num_preemptions
    if num_kv_blocks == 3000:
        assert runs[0].stats.num_preemptions > 0


@pytest.mark.slow
def test_fast_forward_on_a_fleet_keeps_the_numbers() -> None:
    spec = three_tier_mix(60, 10, seed=4)
    stats = [
        simulate(spec, "tiered", FleetSpec(H200, 4), SimOptions(fast_forward=ff)).stats
        for ff in (False, True)
    ]
    for tier in ("priority", "interactive", "batch"):
        exact, fast = stats[0].tiers[tier], stats[1].tiers[tier]
        assert fast.num_finished == exact.num_finished
        assert fast.ttft_p50_ms == pytest.approx(exact.ttft_p50_ms, rel=0.2)
        assert fast.tpot_p50_ms == pytest.approx(exact.tpot_p50_ms, rel=0.05)
    assert stats[1].output_tokens_per_s == pytest.approx(stats[0].output_tokens_per_s, rel=0.01)


def test_real_admission_refuses_interactive_overload_and_keeps_admitted_within_slo() -> None:
    # Priority + interactive at about 1.7x what the engine serves, no batch to absorb it:
    # the gateway's SLO admission must refuse, and what it admits must meet its SLO. The
    # backlog sits mostly inside the engine (a worker pulls while it has a free slot), so
    # this holds only because simulated workers publish their engines' backlog per rank.
    spec = three_tier_mix(50, 10, seed=6, tier_load_shares=(0.2, 0.8, 0.0))
    options = SimOptions(drain_s=30, fast_forward=True)
    stats = simulate(spec, "tiered", FleetSpec(H200, 1), options).stats
    interactive = stats.tiers["interactive"]
    assert interactive.rejections.get("slo_unattainable", 0) > 0
    assert interactive.admitted_attainment > 0.9
    assert stats.tiers["priority"].admitted_attainment > 0.99
    fcfs = simulate(spec, "fcfs", FleetSpec(H200, 1), options).stats
    assert fcfs.tiers["interactive"].admitted_attainment < 0.6


def test_fast_forward_charges_the_per_sequence_overhead_as_single_steps() -> None:
    params = replace(H200, overhead_per_seq_s=0.0004)
    spec = three_tier_mix(30, 10, seed=3)
    runs = [
        simulate(
            spec, "tiered", FleetSpec(params, 1), SimOptions(keep_records=True, fast_forward=ff)
        )
        for ff in (False, True)
    ]
    exact, fast = ({r.request.request_id: r for r in run.collector.records} for run in runs)
    for request_id, record in exact.items():
        assert fast[request_id].finish_s == pytest.approx(record.finish_s, abs=1e-9)
    plain = simulate(spec, "tiered", FleetSpec(H200, 1), SimOptions()).stats
    assert runs[0].stats.tiers["batch"].tpot_p50_ms > plain.tiers["batch"].tpot_p50_ms


def test_fast_forward_reports_a_first_token_made_by_a_one_token_prefill_chunk() -> None:
    # A 101-token prompt in chunks of 100 leaves one prompt token for the next step:
    # that step looks like a decode but makes the first token, so no run may start there.
    params = replace(H200, max_prefill_chunk_tokens=100)
    tier = TierSpec(
        "t", 0, prompt_len=LengthDist("fixed", mean=101), output_len=LengthDist("fixed", mean=20)
    )
    spec = WorkloadSpec((tier,), (TenantSpec("a", "t"),), rate_per_s=0.2, duration_s=8, seed=1)
    records = [
        simulate(
            spec, "fcfs", FleetSpec(params, 1), SimOptions(keep_records=True, fast_forward=ff)
        ).collector.records[0]
        for ff in (False, True)
    ]
    exact, fast = records
    assert exact.first_token_s is not None
    assert fast.first_token_s == pytest.approx(exact.first_token_s, abs=1e-12)
    assert fast.finish_s == pytest.approx(exact.finish_s, abs=1e-12)


def test_fast_forward_keeps_the_decode_pauses_of_a_tight_tpot_slo() -> None:
    # An 8 ms TPOT SLO on an H200 makes the step scheduler pause batch decodes once the
    # batch grows; such a step is no plain decode of everyone, so no run may stand for
    # it (before, runs decoded everyone and 73 of these requests moved).
    tiers = (
        TierSpec(
            "fast",
            0,
            ttft_slo_ms=2000,
            tpot_slo_ms=8,
            prompt_len=LengthDist("fixed", mean=200),
            output_len=LengthDist("uniform", low=20, high=200),
        ),
        TierSpec(
            "batch",
            1,
            preemptible=True,
            prompt_len=LengthDist("fixed", mean=300),
            output_len=LengthDist("uniform", low=50, high=400),
        ),
    )
    tenants = (TenantSpec("a", "fast"), TenantSpec("b", "batch", load_share=3.0))
    spec = WorkloadSpec(tiers, tenants, rate_per_s=8, duration_s=10, seed=1)
    runs = [
        simulate(
            spec,
            "tiered",
            FleetSpec(H200, 1),
            SimOptions(keep_records=True, fast_forward=ff, rate_limits=False),
        )
        for ff in (False, True)
    ]
    exact, fast = ({r.request.request_id: r for r in run.collector.records} for run in runs)
    assert exact.keys() == fast.keys()
    for request_id, record in exact.items():
        assert fast[request_id].first_token_s == pytest.approx(record.first_token_s, abs=1e-9)
        assert fast[request_id].finish_s == pytest.approx(record.finish_s, abs=1e-9)
    assert runs[0].stats.num_steps == runs[1].stats.num_steps


def test_an_idle_engine_that_takes_nothing_does_not_stall_arrivals(monkeypatch) -> None:
    # An engine that never accepts (2 KV blocks, all held back by the watermark; a preset
    # file may not say so any more, so the check is bypassed) stays idle with the queue
    # full. An arrival offered it the queue again and again for ever; now it is passed
    # over once and the jobs wait in the queue until the run ends.
    params = load_preset("cpu-tiny")
    object.__setattr__(params, "num_kv_blocks", 2)
    calls = []
    start_step = SimEngine.start_step

    def counted(self: SimEngine) -> float | None:
        calls.append(1)
        if len(calls) > 10_000:
            raise AssertionError("the fleet keeps asking an idle engine to step")
        return start_step(self)

    monkeypatch.setattr(SimEngine, "start_step", counted)
    spec = three_tier_mix(5, 2, seed=1)
    result = simulate(spec, "fcfs", FleetSpec(params, 2), SimOptions(drain_s=1.0))
    tiers = result.stats.tiers.values()
    assert sum(t.num_offered for t in tiers) > 0
    assert sum(t.num_finished for t in tiers) == 0
    assert len(calls) <= 2 * sum(t.num_offered for t in tiers)


def test_a_request_longer_than_the_cache_exceeds_the_context_as_in_the_engine() -> None:
    # LLMEngine caps max_model_len at its cache (num_blocks x block_size); so does the
    # simulated engine, and the refusal is the same typed error.
    params = replace(load_preset("cpu-tiny"), num_kv_blocks=4, block_size=16)
    engine = SimEngine("e", params, EngineMode(), [0.0])
    common = {"rank": 0, "tenant": "t", "arrival_s": 0.0, "ttft_slo_ms": None}
    common |= {"tpot_slo_ms": None, "preemptible": False}
    engine.add("fits", num_prompt_tokens=40, num_output_tokens=24, **common)
    with pytest.raises(ContextLengthExceededError):
        engine.add("long", num_prompt_tokens=40, num_output_tokens=25, **common)
