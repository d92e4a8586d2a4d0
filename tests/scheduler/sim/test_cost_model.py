"""The roofline cost model: presets, the roofline shape, parameter files, calibration."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from scheduler.sim.cost_model import (
    PRESETS,
    CostModelError,
    StepSample,
    StepShape,
    chunk_shape,
    fit_roofline,
    load_params,
    load_preset,
    read_samples,
    save_params,
)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_predict_positive_times(name: str) -> None:
    params = load_preset(name)
    assert params.name == name
    assert params.step_time_s(1, 100, 100) > params.overhead_s
    assert params.step_time_s(0, 0, 0) == 0.0


def test_h200_decode_is_memory_bound_and_long_prefill_compute_bound() -> None:
    p = load_preset("h200-llama-3.1-8b")
    # One decode token reads all 16 GB of weights: ~4-6 ms at H200 bandwidth.
    assert 0.004 < p.step_time_s(1, 512, 512) < 0.008
    assert p.memory_time_s(512) > p.compute_time_s(1, 512)
    kv, pairs = chunk_shape(0, 8192)
    assert p.compute_time_s(8192, pairs) > p.memory_time_s(kv)
    # Decode is nearly free to batch until KV reads dominate; prefill scales linearly.
    assert p.step_time_s(64, 64 * 512, 64 * 512) < 1.5 * p.step_time_s(1, 512, 512)
    assert p.step_time_s(8192, *chunk_shape(0, 8192)) > 4 * p.step_time_s(
        2048, *chunk_shape(0, 2048)
    )


def test_chunk_shape_counts_causal_pairs() -> None:
    assert chunk_shape(10, 1) == (11, 11.0)  # one decode token attends to 11 keys
    assert chunk_shape(0, 4) == (4, 10.0)  # 1 + 2 + 3 + 4


def test_params_round_trip_through_a_file(tmp_path) -> None:
    p = replace(load_preset("cpu-tiny"), overhead_s=0.0123)
    path = tmp_path / "mine.json"
    save_params(p, path)
    assert load_params(path) == p
    assert load_params("cpu-tiny") == load_preset("cpu-tiny")


def test_bad_parameter_files_raise_typed_errors(tmp_path) -> None:
    with pytest.raises(CostModelError, match="neither a preset"):
        load_params(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CostModelError, match="not valid JSON"):
        load_params(bad)
    data = load_preset("cpu-tiny").to_dict()
    bad.write_text(json.dumps({**data, "memory_efficiency": -1}))
    with pytest.raises(CostModelError, match="memory_efficiency"):
        load_params(bad)
    bad.write_text(json.dumps({**data, "warp_speed": 9}))
    with pytest.raises(CostModelError, match="warp_speed"):
        load_params(bad)
    with pytest.raises(CostModelError, match="unknown preset"):
        load_preset("a100")


def test_fit_recovers_overhead_and_efficiencies_from_noisy_steps() -> None:
    base = load_preset("h200-llama-3.1-8b")
    truth = replace(base, overhead_s=0.003, memory_efficiency=0.6, compute_efficiency=0.4)
    rng = random.Random(7)
    samples = []
    for _ in range(200):
        batch = rng.choice([1, 8, 32, 128, 512, 2048, 8192])
        kv = batch * rng.randint(100, 3000) if batch <= 128 else batch + rng.randint(0, 5000)
        shape = StepShape(batch, kv)
        samples.append(StepSample(shape, truth.shape_time_s(shape) * rng.uniform(0.97, 1.03)))
    result = fit_roofline(base, samples)
    assert result.params.overhead_s == pytest.approx(0.003, rel=0.1)
    assert result.params.memory_efficiency == pytest.approx(0.6, rel=0.05)
    assert result.params.compute_efficiency == pytest.approx(0.4, rel=0.05)
    assert result.mean_abs_rel_error < 0.03
    assert result.num_samples == 200


def test_fit_needs_samples_and_reads_json_lines() -> None:
    with pytest.raises(CostModelError, match="at least 3"):
        fit_roofline(load_preset("cpu-tiny"), [])
    rows = read_samples(['{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 0.01}', ""])
    assert rows == [StepSample(StepShape(4, 40), 0.01)]
    with pytest.raises(CostModelError, match="line 1"):
        read_samples(['{"num_batched_tokens": 4}'])


def test_fit_recovers_a_per_sequence_overhead_when_samples_count_sequences() -> None:
    base = load_preset("cpu-tiny")
    truth = replace(
        base,
        overhead_s=0.004,
        overhead_per_seq_s=0.0008,
        memory_efficiency=0.5,
        compute_efficiency=0.3,
    )
    rng = random.Random(11)
    samples = []
    for _ in range(300):
        seqs = rng.choice([1, 2, 4, 8, 16, 32])
        prefill = rng.choice([0, 0, 64, 256])
        tokens = seqs + prefill
        shape = StepShape(tokens, seqs * rng.randint(16, 512) + prefill, None, seqs + (prefill > 0))
        samples.append(StepSample(shape, truth.shape_time_s(shape) * rng.uniform(0.98, 1.02)))
    fitted = fit_roofline(base, samples).params
    assert fitted.overhead_per_seq_s == pytest.approx(0.0008, rel=0.1)
    assert fitted.overhead_s == pytest.approx(0.004, rel=0.1)
    # Without sequence counts there is nothing to fit it from: it stays 0.
    blind = [StepSample(replace(s.shape, num_seqs=0), s.step_s) for s in samples]
    assert fit_roofline(base, blind).params.overhead_per_seq_s == 0.0


def test_per_sequence_overhead_adds_to_every_step() -> None:
    params = replace(load_preset("cpu-tiny"), overhead_per_seq_s=0.001)
    plain = load_preset("cpu-tiny")
    assert params.step_time_s(8, 800, 800.0, 8) == pytest.approx(
        plain.step_time_s(8, 800, 800.0) + 0.008
    )
    assert params.step_time_s(0, 0, 0.0, 3) == 0.0
    rows = read_samples(
        ['{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 0.01, "num_seqs": 4}']
    )
    assert rows[0].shape.num_seqs == 4
