"""Calibration from the real engine: step shapes from real plans, times from real steps."""

from __future__ import annotations

import pytest

from engine.request import Request, SamplingParams
from engine.step_scheduler import ScheduledChunk
from scheduler.sim.calibrate import (
    build_engine,
    calibrate_engine,
    mean_by_shape,
    measure_engine_steps,
    plan_shape,
    write_samples,
)
from scheduler.sim.cost_model import (
    StepSample,
    StepShape,
    fit_roofline,
    load_preset,
    read_samples,
)


@pytest.mark.slow
def test_measure_the_built_in_model_and_fit(tmp_path) -> None:
    samples = measure_engine_steps(
        batch_sizes=(1, 3), prompt_lens=(8, 40), max_tokens=4, num_staggered=0, repeats=1
    )
    # Per batch: one prefill step, then three decode steps (the prefill makes token one).
    assert len(samples) == 4 * 2 * 2
    shapes = [s.shape for s in samples]
    assert shapes[0].num_batched_tokens == 8  # one prompt of 8
    assert shapes[1].num_batched_tokens == 1  # then its decodes
    assert shapes[1].num_kv_tokens == 9
    assert any(s.num_batched_tokens == 3 * 40 for s in shapes)
    assert all(s.step_s > 0 for s in samples)
    path = tmp_path / "steps.jsonl"
    write_samples(samples, path)
    assert read_samples(path.read_text().splitlines()) == samples
    fitted = fit_roofline(load_preset("cpu-tiny"), samples)
    assert fitted.num_samples == len(samples)
    assert fitted.params.overhead_s >= 0


@pytest.mark.slow
def test_staggered_arrivals_make_mixed_steps_and_repeats_keep_one_sample_per_step() -> None:
    once = measure_engine_steps(
        batch_sizes=(2,),
        prompt_lens=(8, 64),
        max_tokens=6,
        num_staggered=8,
        repeats=1,
    )
    twice = measure_engine_steps(
        batch_sizes=(2,),
        prompt_lens=(8, 64),
        max_tokens=6,
        num_staggered=8,
        repeats=2,
    )
    # The same plans each repeat: one sample per step, the median of its times.
    assert [s.shape for s in twice] == [s.shape for s in once]
    # Arrivals while others decode: steps with a decode and a prefill chunk together.
    mixed = [
        s.shape
        for s in once
        if s.shape.num_batched_tokens > 1 and s.shape.num_kv_tokens > s.shape.num_batched_tokens
    ]
    assert mixed


@pytest.mark.slow
def test_calibrate_engine_gives_the_fit_the_engine_limits() -> None:
    result, samples = calibrate_engine(
        load_preset("cpu-tiny"),
        batch_sizes=(1, 2),
        prompt_lens=(8, 16),
        max_tokens=3,
        num_staggered=4,
        repeats=1,
    )
    engine = build_engine()
    params = result.params
    assert params.num_kv_blocks == engine.block_manager.num_blocks
    assert params.max_num_seqs == engine.config.max_num_seqs
    assert params.max_prefill_chunk_tokens == engine.config.max_prefill_chunk_tokens
    assert result.num_samples == len(samples)


def test_plan_shape_sums_chunks() -> None:
    decoding = Request("a", [1] * 10, SamplingParams(max_tokens=4), output_token_ids=[1])
    fresh = Request("b", [1] * 4, SamplingParams(max_tokens=4))
    shape = plan_shape([ScheduledChunk(decoding, 10, 1), ScheduledChunk(fresh, 0, 4)])
    assert (shape.num_batched_tokens, shape.num_kv_tokens) == (5, 15)
    assert shape.num_attention_pairs == 11 + 10


def test_mean_by_shape_averages_steps_of_one_kind() -> None:
    samples = [
        StepSample(StepShape(1, 100, 100.0, 1), 0.004),
        StepSample(StepShape(1, 110, 110.0, 1), 0.008),  # same kind: one token, one sequence
        StepSample(StepShape(6, 700, 700.0, 6), 0.010),  # 6 and 7 share the bin up to 8
        StepSample(StepShape(7, 800, 800.0, 7), 0.012),
        StepSample(StepShape(2, 100, 100.0, 2), 0.005),
    ]
    merged = {s.shape.num_batched_tokens: s for s in mean_by_shape(samples)}
    assert sorted(merged) == [1, 2, 6]  # 6.5 tokens round to 6
    assert merged[1].step_s == pytest.approx(0.006)
    assert merged[1].shape == StepShape(1, 105, 105.0, 1)
    assert merged[6].step_s == pytest.approx(0.011)
    assert merged[2].step_s == 0.005
