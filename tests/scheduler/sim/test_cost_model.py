"""The roofline cost model: presets, the roofline shape, parameter files, calibration."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from pathlib import Path

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
    with pytest.raises(CostModelError, match="at least 4 distinct step shapes"):
        fit_roofline(load_preset("cpu-tiny"), [])
    rows = read_samples(['{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 0.01}', ""])
    assert rows == [StepSample(StepShape(4, 40), 0.01)]
    with pytest.raises(CostModelError, match="line 1"):
        read_samples(['{"num_batched_tokens": 4}'])


def test_a_fit_needs_more_distinct_shapes_than_it_fits_parameters() -> None:
    # Three shapes fit three parameters exactly, and five steps of one shape fit
    # anything: both reported "mean error 0.0%" and wrote a preset.
    base = load_preset("cpu-tiny")
    truth = replace(base, overhead_s=0.004, overhead_per_seq_s=0.001)

    def timed(shapes: list[StepShape]) -> list[StepSample]:
        return [StepSample(s, truth.shape_time_s(s)) for s in shapes]

    three = [StepShape(n, n * 100) for n in (1, 8, 64)]
    with pytest.raises(CostModelError, match=r"at least 4 distinct step shapes .* got 3"):
        fit_roofline(base, timed(three))
    with pytest.raises(CostModelError, match="got 1"):
        fit_roofline(base, timed([StepShape(8, 800)] * 5))
    assert fit_roofline(base, timed([*three, StepShape(512, 51_200)])).num_samples == 4
    # Counting sequences adds overhead_per_seq_s to fit: one shape more.
    counted = [StepShape(n, n * 100, None, n) for n in (1, 8, 64, 512)]
    with pytest.raises(CostModelError, match=r"at least 5 distinct step shapes .* got 4"):
        fit_roofline(base, timed(counted))
    assert fit_roofline(base, timed([*counted, StepShape(2, 200, None, 2)])).num_samples == 5


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


def _params_file(tmp_path, **changes: object):
    """cpu-tiny's parameter file with `changes` (a value of ... drops the field)."""
    data = {**load_preset("cpu-tiny").to_dict(), **changes}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not ...}))
    return path


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_efficiency", 1e308),
        ("memory_efficiency", 1.01),
        ("compute_efficiency", 0),
        ("compute_efficiency", -0.5),
        ("compute_efficiency", True),
        ("memory_efficiency", "0.5"),
    ],
)
def test_efficiencies_are_fractions_of_peak(tmp_path, field: str, value: object) -> None:
    with pytest.raises(CostModelError, match=rf"{field} must be a fraction of peak in \(0, 1\]"):
        load_params(_params_file(tmp_path, **{field: value}))
    assert getattr(load_params(_params_file(tmp_path, **{field: 1})), field) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_size", 16.5),
        ("block_size", True),
        ("num_kv_blocks", 0),
        ("max_num_seqs", "8"),
        ("max_num_batched_tokens", 10**400),
        # The engine's own config refuses 0; None (null) is its "no cap".
        ("max_prefill_chunk_tokens", 0),
        ("max_prefill_chunk_tokens", False),
    ],
    ids=lambda value: repr(value)[:24],
)
def test_counts_must_be_whole_numbers(tmp_path, field: str, value: object) -> None:
    with pytest.raises(CostModelError, match=f"{field} must be a whole number >= 1"):
        load_params(_params_file(tmp_path, **{field: value}))


def test_whole_floats_are_counts_and_null_is_no_chunk_cap(tmp_path) -> None:
    params = load_params(_params_file(tmp_path, num_kv_blocks=2.048e3, block_size=16.0))
    assert params.num_kv_blocks == 2048
    assert type(params.num_kv_blocks) is int
    assert type(params.block_size) is int
    params = load_params(_params_file(tmp_path, max_prefill_chunk_tokens=None))
    assert params.scheduler_config(4096).max_prefill_chunk_tokens == params.max_num_batched_tokens


@pytest.mark.parametrize(
    ("literal", "field"),
    [("NaN", "num_params"), ("Infinity", "weight_bytes"), ("-Infinity", "overhead_s")],
)
def test_nan_and_infinity_literals_are_refused(tmp_path, literal: str, field: str) -> None:
    # Python's json reads these non-standard literals as floats.
    path = _params_file(tmp_path, **{field: 123456789})
    path.write_text(path.read_text().replace("123456789", literal))
    with pytest.raises(CostModelError, match=f"{field} must be a finite number"):
        load_params(path)


def test_missing_fields_are_all_named(tmp_path) -> None:
    path = _params_file(tmp_path, num_params=..., peak_flops_per_s=...)
    with pytest.raises(CostModelError) as raised:
        load_params(path)
    assert str(raised.value) == (
        f"{path}: the cost model misses fields: num_params, peak_flops_per_s"
    )


def test_limits_no_engine_could_run_are_refused(tmp_path) -> None:
    # The step scheduler admits only while more than its 2 watermark blocks are free.
    with pytest.raises(CostModelError, match="num_kv_blocks must be at least 3"):
        load_params(_params_file(tmp_path, num_kv_blocks=2))
    assert load_params(_params_file(tmp_path, num_kv_blocks=3)).num_kv_blocks == 3
    with pytest.raises(CostModelError, match="max_num_batched_tokens must be >= max_num_seqs"):
        load_params(_params_file(tmp_path, max_num_batched_tokens=1))
    with pytest.raises(CostModelError, match="at most"):
        load_params(_params_file(tmp_path, num_kv_blocks=10**9))
    with pytest.raises(CostModelError, match="step times that are not finite"):
        load_params(_params_file(tmp_path, num_params=1e308))
    with pytest.raises(CostModelError, match="name must be a string"):
        load_params(_params_file(tmp_path, name=5))


def test_the_model_length_is_capped_by_the_cache_as_in_the_engine() -> None:
    params = replace(load_preset("cpu-tiny"), num_kv_blocks=4, block_size=16)
    assert params.scheduler_config(16384).max_model_len == 64
    assert load_preset("cpu-tiny").scheduler_config(2048).max_model_len == 2048


def test_files_that_are_not_cost_models_raise_typed_errors(tmp_path, monkeypatch) -> None:
    with pytest.raises(CostModelError, match="is a directory"):
        load_params(tmp_path)
    path = tmp_path / "p.json"
    for text, match in [
        ("[1, 2]", "expected a JSON object, got list"),
        ("", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
        (" " * (2**20 + 1), "larger than"),
    ]:
        path.write_text(text)
        with pytest.raises(CostModelError, match=match):
            load_params(path)
    path.write_bytes(b'{"name": "\xff"}')
    with pytest.raises(CostModelError, match="not UTF-8"):
        load_params(path)

    def unreadable(*args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied")

    # Tests may run as root, whom file modes do not stop.
    monkeypatch.setattr(Path, "open", unreadable)
    with pytest.raises(CostModelError, match=r"cannot read it \(Permission denied\)"):
        load_params(path)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"num_batched_tokens": 4, "num_kv_tokens": 1e999, "step_s": 1}', "num_kv_tokens"),
        ('{"num_batched_tokens": true, "num_kv_tokens": 4, "step_s": 1}', "num_batched_tokens"),
        ('{"num_batched_tokens": 4, "num_kv_tokens": 4, "step_s": NaN}', "step_s"),
        ('{"num_batched_tokens": 4, "num_kv_tokens": 4, "step_s": 1, "num_seqs": -1}', "num_seqs"),
        (
            '{"num_batched_tokens": 4, "num_kv_tokens": 4, "step_s": 1, '
            '"num_attention_pairs": "x"}',
            "num_attention_pairs",
        ),
        ("[1]", "expected a JSON object"),
    ],
)
def test_sample_lines_that_are_no_step_are_refused(line: str, match: str) -> None:
    with pytest.raises(CostModelError, match=f"sample line 2: .*{match}"):
        read_samples(['{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 0.01}', line])


def test_the_fit_raises_hardware_numbers_the_steps_outran(tmp_path) -> None:
    # Steps three times faster than the base's bandwidth allows, with prefills that
    # need twice its peak: pinned at an efficiency of 1, the fit put the rest into the
    # overheads and mispredicted every step. The excess now goes into the numbers, and
    # the efficiencies stay fractions of peak, so the fitted file loads again.
    base = load_preset("cpu-tiny")
    truth = replace(
        base,
        memory_bandwidth_bytes_per_s=3 * base.memory_bandwidth_bytes_per_s,
        peak_flops_per_s=2 * base.peak_flops_per_s,
        memory_efficiency=1.0,
        compute_efficiency=1.0,
        overhead_s=0.001,
    )
    shapes = [StepShape(n, n * 100) for n in (1, 2, 4, 8, 16, 32)]
    shapes += [StepShape(n, n, *chunk_shape(0, n)[1:]) for n in (128, 256, 512, 1024)]
    result = fit_roofline(base, [StepSample(s, truth.shape_time_s(s)) for s in shapes])
    fitted = result.params
    assert (fitted.memory_efficiency, fitted.compute_efficiency) == (1.0, 1.0)
    assert fitted.memory_bandwidth_bytes_per_s == pytest.approx(3e10, rel=0.02)
    assert fitted.peak_flops_per_s == pytest.approx(1e11, rel=0.02)
    assert fitted.overhead_s == pytest.approx(0.001, rel=0.02)
    assert result.mean_abs_rel_error < 0.01
    save_params(fitted, tmp_path / "fitted.json")
    assert load_params(tmp_path / "fitted.json") == fitted


_OK = '{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 0.01}'


@pytest.mark.parametrize(
    ("line", "match"),
    [
        # Finite but beyond any step: each crashed the fit (1/t² underflowing to 0, a
        # weight sum of 0, a square overflowing) or wrote a preset with "inf%" error.
        ('{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 1e-200}', "step_s"),
        ('{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 1e-8}', "step_s"),
        ('{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 1e200}', "step_s"),
        ('{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 20000}', "step_s"),
        ('{"num_batched_tokens": 1e12, "num_kv_tokens": 40, "step_s": 1}', "num_batched_tokens"),
        ('{"num_batched_tokens": 4, "num_kv_tokens": 1e12, "step_s": 1}', "num_kv_tokens"),
        (
            '{"num_batched_tokens": 4, "num_kv_tokens": 40, "step_s": 1, "num_seqs": 1e12}',
            "num_seqs",
        ),
        (
            '{"num_batched_tokens": 1, "num_kv_tokens": 100, "step_s": 0.005, '
            '"num_attention_pairs": 1e308}',
            "num_attention_pairs",
        ),
        (
            '{"num_batched_tokens": 2, "num_kv_tokens": 100, "step_s": 0.005, '
            '"num_attention_pairs": 201}',
            "num_attention_pairs",
        ),
    ],
)
def test_sample_values_beyond_one_engine_step_are_refused(line: str, match: str) -> None:
    with pytest.raises(CostModelError, match=f"sample line 2: {match} must be"):
        read_samples([_OK, line])


def test_sample_values_at_the_edges_of_their_ranges_are_read() -> None:
    lines = [
        '{"num_batched_tokens": 1073741824, "num_kv_tokens": 1073741824, "step_s": 10000, '
        '"num_seqs": 1073741824, "num_attention_pairs": 1.15e18}',
        '{"num_batched_tokens": 2, "num_kv_tokens": 100, "step_s": 1e-7, '
        '"num_attention_pairs": 200}',
        '{"num_batched_tokens": 0, "num_kv_tokens": 0, "step_s": 0}',
    ]
    assert [s.step_s for s in read_samples(lines)] == [1e4, 1e-7, 0.0]


@pytest.mark.parametrize("step_s", [1e-200, 1e200])
def test_a_fit_the_floats_cannot_do_is_a_cost_model_error(step_s: float) -> None:
    # Samples built in code skip read_samples' ranges: the fit itself must not crash.
    shapes = [StepShape(n, n * 100) for n in (1, 8, 64, 512)]
    with pytest.raises(CostModelError, match="cannot be fitted"):
        fit_roofline(load_preset("cpu-tiny"), [StepSample(s, step_s) for s in shapes])


def test_a_base_whose_predictions_overflow_on_the_samples_is_a_cost_model_error() -> None:
    # A valid base (its own longest step is finite) and valid samples, but 2^30 tokens
    # at 10^300 parameters is no float: before, "mean error inf%" and a written preset.
    base = replace(load_preset("cpu-tiny"), num_params=1e300, peak_flops_per_s=1e300)
    shapes = [StepShape(2**30 - n, 2**30) for n in range(4)]
    with pytest.raises(CostModelError, match="cannot be fitted with base 'cpu-tiny'"):
        fit_roofline(base, [StepSample(s, 0.01 * (n + 1)) for n, s in enumerate(shapes)])


def test_samples_files_that_are_no_regular_files_or_too_large_are_refused(
    tmp_path, monkeypatch
) -> None:
    from scheduler.sim import cost_model

    # A pipe was read until its writer stopped, /dev/zero until memory ran out (the CLI
    # test runs that one in a process of its own): neither is opened now.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CostModelError, match="not a regular file"):
        cost_model.read_samples_file(fifo)
    path = tmp_path / "steps.jsonl"
    path.write_text((_OK + "\n") * 3)
    assert len(cost_model.read_samples_file(path)) == 3
    monkeypatch.setattr(cost_model, "MAX_SAMPLES_FILE_BYTES", len(_OK) * 2)
    with pytest.raises(CostModelError, match=r"larger than .* bytes, not a samples file"):
        cost_model.read_samples_file(path)


def test_attention_flops_per_token_pair_must_be_positive(tmp_path) -> None:
    # The doc says FLOP counts are > 0; 0 was accepted (attention for free).
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps({**load_preset("cpu-tiny").to_dict(), "attention_flops_per_token_pair": 0})
    )
    with pytest.raises(
        CostModelError, match="attention_flops_per_token_pair must be a finite number > 0"
    ):
        load_params(path)
