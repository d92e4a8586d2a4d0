"""`tiergate simulate` through its argparse entry point."""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.sim.cli import add_simulate_parser, main, reproduce_command
from scheduler.sim.cost_model import StepShape, load_params, load_preset


def test_presets_and_run(capsys) -> None:
    assert main(["presets"]) == 0
    assert "h200-llama-3.1-8b" in capsys.readouterr().out
    assert main(["presets", "cpu-tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "cpu-tiny"
    assert main(["run", "--policy", "fcfs", "--rate", "5", "--duration", "5", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tiers"]["interactive"]["num_offered"] > 0


def test_run_table_names_its_throughput_and_shows_unfinished_requests(capsys) -> None:
    argv = ["run", "--policy", "fcfs", "--rate", "5", "--duration", "5", "--drain", "0"]
    assert main([*argv, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    headline, header, *rows = capsys.readouterr().out.splitlines()
    # Tokens generated while requests arrived, over the arrival time: not all tokens.
    tokens = round(stats["output_tokens_per_s"])
    assert f"{tokens} output tokens/s while arrivals ran" in headline
    # With --drain 0 some requests are unfinished: visible in the table, not only in --json.
    assert header.split()[3] == "unfinished"
    unfinished = {r.split()[0]: int(r.split()[3]) for r in rows}
    assert unfinished == {t: s["num_unfinished"] for t, s in stats["tiers"].items()}
    assert sum(unfinished.values()) > 0


def test_bad_input_exits_2_with_a_message(capsys, tmp_path) -> None:
    assert main(["run", "--rate", "1", "--preset", str(tmp_path / "nope.json")]) == 2
    assert "neither a preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "--loads", "a,b"])


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--rate", "nan"],
        ["run", "--rate", "inf"],
        ["run", "--rate", "0"],
        ["run", "--rate", "5", "--drain", "-1"],
        ["run", "--rate", "5", "--duration", "nan"],
        ["report", "--loads", "1,inf"],
    ],
)
def test_numbers_that_are_no_load_are_usage_errors(capsys, argv) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_run_with_clients_asking_more_than_they_use(capsys) -> None:
    argv = ["run", "--rate", "5", "--duration", "5", "--json"]
    assert main([*argv, "--max-tokens", "2048"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tiers"]["interactive"]["num_finished"] > 0
    for bad in ("0", "16384", "1000000000"):
        assert main([*argv, "--max-tokens", bad]) == 2
        assert "--max-tokens must be between 1 and 16,383" in capsys.readouterr().err
    # Some prompts + max_tokens past the context: refused as the gateway would, and said.
    assert main([*argv, "--max-tokens", "16000"]) == 0
    captured = capsys.readouterr()
    assert "exceeds the simulated context of 16,384 tokens" in captured.err
    assert json.loads(captured.out)["tiers"]["interactive"]["num_finished"] > 0


def test_a_run_too_large_to_generate_is_refused_up_front(capsys) -> None:
    # 5e9 arrivals would be generated before the first step: refused at once instead.
    assert main(["run", "--rate", "1e9", "--duration", "5"]) == 2
    assert "at most" in capsys.readouterr().err


def _write_samples(tmp_path, truth, shapes: list[StepShape]):
    """A calibration sample file: each shape timed exactly as `truth` predicts."""
    lines = [
        json.dumps(
            {
                "num_batched_tokens": shape.num_batched_tokens,
                "num_kv_tokens": shape.num_kv_tokens,
                "step_s": truth.shape_time_s(shape),
            }
        )
        for shape in shapes
    ]
    samples = tmp_path / "steps.jsonl"
    samples.write_text("\n".join(lines))
    return samples


def test_calibrate_writes_a_fitted_parameter_file(tmp_path, capsys) -> None:
    truth = replace(load_preset("cpu-tiny"), overhead_s=0.006, memory_efficiency=0.3)
    rng = random.Random(3)
    batches = [rng.choice([1, 4, 16, 64, 256, 1024]) for _ in range(60)]
    shapes = [StepShape(b, b * rng.randint(1, 200)) for b in batches]
    samples = _write_samples(tmp_path, truth, shapes)
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--samples", str(samples), "--out", str(out)]) == 0
    assert "fitted 60 steps" in capsys.readouterr().out
    fitted = load_params(out)
    assert fitted.overhead_s == pytest.approx(0.006, rel=0.05)
    assert fitted.memory_efficiency == pytest.approx(0.3, rel=0.05)


def test_registers_under_another_cli_with_func(capsys) -> None:
    import argparse

    from scheduler.sim.cli import add_simulate_parser

    parser = argparse.ArgumentParser(prog="tiergate")
    add_simulate_parser(parser.add_subparsers())
    args = parser.parse_args(["simulate", "presets"])
    assert args.func(args) == 0
    assert "cpu-tiny" in capsys.readouterr().out


def _preset(tmp_path: Path, **changes: object) -> str:
    """The H200 preset as a user-edited file, with `changes` (a value of ... drops it)."""
    data = {**load_preset("h200-llama-3.1-8b").to_dict(), **changes}
    path = tmp_path / "q.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not ...}))
    return str(path)


def test_a_kv_cache_too_small_for_any_request_is_refused_not_a_hang(tmp_path) -> None:
    # The reported command; before, the engine never took a request and the fleet asked
    # it again for ever. Run as a process so that a hang fails the test, not the session.
    preset = _preset(tmp_path, num_kv_blocks=2)
    argv = ["run", "--preset", preset, "--rate", "5", "--duration", "5"]
    done = subprocess.run(
        [sys.executable, "-m", "scheduler.sim.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {preset}: num_kv_blocks must be at least 3: the step scheduler keeps 2 "
        "blocks free, so a cache of 2 never takes a request"
    ]


def test_requests_the_cache_can_never_hold_are_refused_as_the_engine_does(tmp_path, capsys) -> None:
    # 3 blocks of 16 hold no request of the mix: the real engine refuses each one
    # (the dispatcher fails it as invalid_request), and says why.
    argv = ["run", "--preset", _preset(tmp_path, num_kv_blocks=3), "--rate", "5", "--json"]
    assert main([*argv, "--duration", "5"]) == 0
    out, err = capsys.readouterr()
    tiers = json.loads(out)["tiers"]
    # The gateway admitted them and the engine refused them: drops of admitted requests
    # (misses), apart from the refusals at admission, which `rejections` alone counts.
    for t in tiers.values():
        assert t["dropped"] == {"invalid_request": t["num_offered"]}
        assert (t["rejections"], t["num_admitted"]) == ({}, t["num_offered"])
    assert "KV cache of 48 tokens" in err
    assert "the workload's longest takes 480 blocks" in err


BAD_PRESETS = {
    "efficiency above 1": {"memory_efficiency": 1e308},
    "efficiency 0": {"compute_efficiency": 0},
    "missing fields": {"num_params": ..., "peak_flops_per_s": ...},
    "fractional count": {"block_size": 16.5},
    "boolean count": {"max_num_seqs": True},
    "boolean number": {"overhead_s": True},
    "chunk cap 0": {"max_prefill_chunk_tokens": 0},
    "budget below seqs": {"max_num_batched_tokens": 1},
}


@pytest.mark.parametrize("command", ["run", "report", "calibrate"])
@pytest.mark.parametrize("change", BAD_PRESETS)
def test_every_command_refuses_a_bad_preset_in_one_line(
    tmp_path, capsys, monkeypatch, command: str, change: str
) -> None:
    # Refused before any simulation: one running would be a missed check.
    monkeypatch.setattr("scheduler.sim.cli.simulate", _no_simulation)
    monkeypatch.setattr("scheduler.sim.cli.run_experiment", _no_simulation)
    preset = _preset(tmp_path, **BAD_PRESETS[change])
    argv = {
        "run": ["run", "--rate", "5", "--duration", "5", "--preset", preset],
        "report": ["report", "--out", str(tmp_path / "r"), "--preset", preset],
        "calibrate": ["calibrate", "--samples", "x", "--out", "y", "--base", preset],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {preset}: ")
    if change == "missing fields":
        assert err.endswith("the cost model misses fields: num_params, peak_flops_per_s\n")


def _no_simulation(*args: object, **kwargs: object) -> None:
    raise AssertionError("the command simulated instead of refusing its input")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{nope", "not valid JSON"),
        ('["a", "list"]', "expected a JSON object, got list"),
        ('{"warp": NaN}', "unknown cost model fields: warp"),
        (None, "is a directory"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_a_preset_file_that_is_no_cost_model_is_one_line(
    tmp_path, capsys, content: str | bytes | None, expected: str
) -> None:
    path = tmp_path / "p.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert main(["run", "--rate", "5", "--duration", "5", "--preset", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("error: ")
    assert expected in err


def test_a_nan_literal_in_a_preset_names_its_field(tmp_path, capsys) -> None:
    path = Path(_preset(tmp_path, weight_bytes=123456789))
    path.write_text(path.read_text().replace("123456789", "NaN"))
    assert main(["run", "--rate", "5", "--preset", str(path)]) == 2
    assert "weight_bytes must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "is a directory"),
        (b"\xff\xfe", "not UTF-8 text"),
        (b'{"num_batched_tokens": 4, "num_kv_tokens": 1e999, "step_s": 1}', "num_kv_tokens"),
        # Finite values beyond any step: tracebacks (exit 1) or a preset with "inf%" error.
        (b'{"num_batched_tokens": 1, "num_kv_tokens": 100, "step_s": 1e-200}\n' * 3, "step_s"),
        (b'{"num_batched_tokens": 1, "num_kv_tokens": 100, "step_s": 1e200}\n' * 3, "step_s"),
        (
            b'{"num_batched_tokens": 1000000000000, "num_kv_tokens": 1000000000000, '
            b'"step_s": 0.005, "num_attention_pairs": 1e300}\n' * 3,
            "num_batched_tokens",
        ),
        (
            b'{"num_batched_tokens": 1, "num_kv_tokens": 100, "step_s": 0.005, '
            b'"num_attention_pairs": 1e308}\n' * 3,
            "num_attention_pairs",
        ),
    ],
)
def test_calibrate_refuses_samples_that_are_no_steps_in_one_line(
    tmp_path, capsys, content: bytes | None, expected: str
) -> None:
    samples = tmp_path / "steps.jsonl"
    if content is None:
        samples.mkdir()
    else:
        samples.write_bytes(content)
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--samples", str(samples), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert expected in err
    assert not out.exists()


def test_calibrate_raises_a_hardware_number_the_steps_outran_and_says_so(tmp_path, capsys) -> None:
    # Steps faster than cpu-tiny's bandwidth allows; the fit would want an efficiency of 3.
    base = load_preset("cpu-tiny")
    truth = replace(
        base,
        memory_bandwidth_bytes_per_s=3 * base.memory_bandwidth_bytes_per_s,
        memory_efficiency=1.0,
    )
    samples = _write_samples(tmp_path, truth, [StepShape(n, n * 100) for n in (1, 2, 4, 8, 16, 32)])
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--samples", str(samples), "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert "the steps ran faster than --base's memory_bandwidth_bytes_per_s (1e+10)" in said.err
    assert "peak_flops_per_s" not in said.err
    # The raised number fits the steps (a pinned efficiency left the overheads to absorb
    # the rest); which of the collinear terms takes what is not identifiable here.
    assert "mean error 0.0%" in said.out
    fitted = load_params(out)
    assert fitted.memory_efficiency == 1.0
    assert fitted.memory_bandwidth_bytes_per_s > base.memory_bandwidth_bytes_per_s
    # Labelled as a fit in the reports that run it, not as the stock preset.
    assert fitted.name == "cpu-tiny-calibrated"
    assert fitted.description == "cpu-tiny fitted to 6 measured steps"
    # The written file is a preset every command takes.
    assert main(["run", "--rate", "2", "--duration", "2", "--preset", str(out), "--json"]) == 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--rate", "0.001", "--duration", "1e9"], "a run simulates at most"),
        (["run", "--rate", "1", "--duration", "600000", "--drain", "10000"], "at most"),
        (["run", "--rate", "1", "--engines", "100000"], "--engines must be at most"),
        (["run", "--rate", "1", "--engines", "1000"], "a simulated fleet holds at most"),
        (["report", "--duration", "1e9", "--out", "r"], "a run simulates at most"),
        (["report", "--suite-duration", "1e9", "--out", "r"], "--suite-duration + --drain"),
    ],
)
def test_runs_too_long_or_too_large_to_simulate_are_refused_up_front(
    capsys, monkeypatch, argv: list[str], expected: str
) -> None:
    # --duration 1e9 at a tiny rate was ~10^9 idle samples: hours, and memory for each.
    monkeypatch.setattr("scheduler.sim.cli.simulate", _no_simulation)
    monkeypatch.setattr("scheduler.sim.cli.run_experiment", _no_simulation)
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    "changes",
    [
        {"max_num_seqs": 1},
        {"max_num_seqs": 1, "max_num_batched_tokens": 1},
        {"block_size": 1},
        {"max_prefill_chunk_tokens": 1},
        {"max_prefill_chunk_tokens": None},
    ],
)
def test_extreme_but_valid_limits_finish(tmp_path, capsys, changes: dict[str, object]) -> None:
    argv = ["run", "--preset", _preset(tmp_path, **changes), "--json", "--drain", "0"]
    assert main([*argv, "--rate", "5", "--duration", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["num_steps"] > 0


def test_simulate_without_a_command_lists_the_commands(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "required: {run,report,presets,calibrate}" in err
    assert "simulate_command" not in err


def _calibrate_measure(tmp_path: Path, *argv: str) -> list[str]:
    return ["calibrate", "--measure", "--out", str(tmp_path / "fitted.json"), *argv]


def test_calibrate_measure_refuses_a_model_it_cannot_load_in_one_line(tmp_path, capsys) -> None:
    assert main(_calibrate_measure(tmp_path, "--model", str(tmp_path / "nope"))) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: --model {tmp_path / 'nope'} on --device cpu: model directory "
        f"'{tmp_path / 'nope'}' does not exist"
    ]
    assert not (tmp_path / "fitted.json").exists()


def test_calibrate_measure_refuses_a_device_it_cannot_use_in_one_line(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(_calibrate_measure(tmp_path, "--device", "tpu"))
    assert exited.value.code == 2
    assert "invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda')" in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda would measure")
    assert main(_calibrate_measure(tmp_path, "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("error: --model tiny-random on --device cuda: ")
    assert "CUDA is not available" in err


def test_calibrate_refuses_samples_too_few_shapes_to_fit_in_one_line(tmp_path, capsys) -> None:
    truth = replace(load_preset("cpu-tiny"), overhead_s=0.006)
    samples = _write_samples(tmp_path, truth, [StepShape(n, n * 100) for n in (1, 2, 4)])
    out = tmp_path / "fitted.json"
    assert main(["calibrate", "--samples", str(samples), "--out", str(out)]) == 2
    [error] = capsys.readouterr().err.splitlines()
    assert error.startswith("error: calibration needs steps of at least 4 distinct step shapes")
    assert not out.exists()


def test_calibrate_refuses_to_write_the_preset_over_its_samples(tmp_path, capsys) -> None:
    samples = _write_samples(
        tmp_path, load_preset("cpu-tiny"), [StepShape(n, n * 100) for n in (1, 8)]
    )
    before = samples.read_bytes()
    for argv in (
        ["calibrate", "--samples", str(samples), "--out", str(samples)],
        ["calibrate", "--measure", "--save-samples", str(samples), "--out", str(samples)],
    ):
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines() == ["error: --out must not be the samples file"]
        assert samples.read_bytes() == before


@pytest.mark.parametrize("flag", ["--out", "--save-samples"])
def test_calibrate_measure_refuses_an_output_it_cannot_write_before_measuring(
    tmp_path, capsys, flag: str
) -> None:
    # Before, the engine was timed for a minute and the result then lost. Neither output
    # may exist after: a samples file would show that it measured, a fitted.json that
    # checking --out left its probe behind.
    bad = tmp_path / "no-such-dir" / "x.json"
    samples, out = tmp_path / "steps.jsonl", tmp_path / "fitted.json"
    outputs = {"--out": out, "--save-samples": samples, flag: bad}
    argv = ["calibrate", "--measure"]
    for name, path in outputs.items():
        argv += [name, str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {flag} {bad} cannot be written: No such file or directory"]
    assert not samples.exists()
    assert not out.exists()


def _small_report(out: Path) -> list[str]:
    return [
        "report",
        "--duration", "1", "--drain", "1", "--suite-duration", "1", "--no-plots",
        "--capacity", "2", "--loads", "1", "--policies", "fcfs", "--suites", "weighted",
        "--out", str(out),
    ]  # fmt: skip


@pytest.mark.parametrize("where", ["a file", "under a file", "report.md a directory"])
def test_report_refuses_an_out_it_cannot_write_before_the_sweep(
    tmp_path, capsys, where: str
) -> None:
    # Before, the sweep ran (minutes, at real sizes) and only writing the report failed.
    file = tmp_path / "file"
    file.write_text("keep me")
    out = {"a file": file, "under a file": file / "r", "report.md a directory": tmp_path / "r"}
    if where == "report.md a directory":
        (tmp_path / "r" / "report.md").mkdir(parents=True)
    assert main(_small_report(out[where])) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1  # no progress line: nothing was simulated
    assert err[0].startswith("error: --out ")
    assert file.read_text() == "keep me"
    assert not (tmp_path / "r" / "report.json").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--capacity", "1e12"], "the sweep 4.54e+14 (4 policies at 0.5-2x of 1e+12 requests/s"),
        (["--capacity", "20", "--loads", "1e9"], "at 1-1e+09x of 20 requests/s for 5 s"),
        (["--capacity", "20", "--suite-duration", "1e5"], "the suites 3e+08 (5 x 4 policies"),
    ],
)
def test_a_report_too_large_to_finish_is_refused_up_front(
    tmp_path, argv: list[str], expected: str
) -> None:
    # Before, these ran for days: a process, so that a hang fails the test.
    out = tmp_path / "r"
    base = ["report", "--duration", "5", "--drain", "5", "--no-plots", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "scheduler.sim.cli", *base, *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("error: the report would offer ")
    assert expected in line
    assert line.endswith("a report offers at most 50,000,000")
    assert not out.exists()


def _at_most_1_gib() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))


def test_calibrate_refuses_a_samples_device_in_one_line(tmp_path) -> None:
    # /dev/zero was read until memory ran out: a process with 1 GiB of address space, so
    # that a regression is a MemoryError there, not a machine out of memory.
    out = tmp_path / "fitted.json"
    argv = ["calibrate", "--samples", "/dev/zero", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "scheduler.sim.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_at_most_1_gib,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: /dev/zero: not a regular file (a device or a pipe), not samples"
    ]
    assert not out.exists()


def test_calibrate_refuses_save_samples_with_samples(tmp_path, capsys) -> None:
    # Before, --save-samples was silently ignored with --samples.
    truth = replace(load_preset("cpu-tiny"), overhead_s=0.006)
    samples = _write_samples(tmp_path, truth, [StepShape(n, n * 100) for n in (1, 2, 4, 8)])
    out, saved = tmp_path / "fitted.json", tmp_path / "saved.jsonl"
    argv = ["calibrate", "--samples", str(samples), "--out", str(out)]
    assert main([*argv, "--save-samples", str(saved)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --save-samples goes with --measure, not --samples"
    ]
    assert not out.exists()
    assert not saved.exists()


def test_report_without_plots_removes_the_plots_of_an_earlier_report(tmp_path, capsys) -> None:
    out = tmp_path / "r"
    out.mkdir()
    for name in ("attainment.png", "goodput.png"):
        (out / name).write_bytes(b"an earlier report's plot")
    assert main(_small_report(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    # Only fcfs and tiered ran: target 4 compares with vtc and priority, so it is n/a.
    assert "target 4: n/a" in capsys.readouterr().out


def test_report_takes_a_drain_of_0_as_run_does(tmp_path, capsys) -> None:
    argv = _small_report(tmp_path / "r")
    argv[argv.index("--drain") + 1] = "0"
    assert main(argv) == 0
    assert json.loads((tmp_path / "r" / "report.json").read_text())["capacity_rate_per_s"] == 2


def test_report_refuses_a_capacity_search_with_no_interactive_request_to_measure(
    tmp_path, capsys
) -> None:
    # Steps of 3 s: FCFS misses everywhere, and the bisection went down to rates that
    # offer no interactive request; those "kept 90%", so 1.0x came out as 0 requests/s
    # and target 3 passed at "100%" with nothing offered.
    out = tmp_path / "r"
    argv = ["report", "--preset", _preset(tmp_path, overhead_s=3.0), "--duration", "5"]
    argv += ["--drain", "5", "--suite-duration", "5", "--no-plots", "--out", str(out)]
    assert main(argv) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert error.startswith("error: the FCFS capacity search offered no interactive request")
    assert not (out / "report.json").exists()


def test_report_says_why_a_target_is_not_applicable(tmp_path, capsys) -> None:
    # 0.5 req/s of 1.0x = 5: nothing reaches overload, every goodput is a lower bound.
    # Target 4 printed FAIL "1.00x vtc" before.
    out = tmp_path / "r"
    argv = ["report", "--capacity", "5", "--loads", "0.5", "--duration", "10", "--drain", "30"]
    argv += ["--suites", "weighted", "--suite-duration", "5", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("target 4:")]
    assert line.startswith("target 4: n/a")
    assert "(n/a: " in line
    assert "lower bound" in line
    report = (out / "report.md").read_text()
    assert "**n/a** (" in report
    [target] = [
        t for t in json.loads((out / "report.json").read_text())["targets"] if t["number"] == 4
    ]
    assert target["measured"] is False
    assert "lower bound" in target["reason"]


def test_report_refuses_loads_that_print_alike(tmp_path, capsys) -> None:
    # 1.0000001 and 1.5000001 print as 1 and 1.5, the loads every report adds: the JSON
    # sweep lost runs under one key, report.md repeated rows, Reproduce said 1,1,1.5,1.5.
    argv = _small_report(tmp_path / "r")
    argv[argv.index("--loads") + 1] = "1.0000001,1.5000001"
    assert main(argv) == 2
    [error] = capsys.readouterr().err.splitlines()
    assert error == (
        "error: loads 1 and 1.0000001 print alike as 1x; give loads that differ in their "
        "first 6 significant digits"
    )
    assert not (tmp_path / "r" / "report.json").exists()


def _report_args(*argv: str):
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", "report", *argv])


def test_the_reproduce_line_repeats_every_flag_that_shaped_the_report() -> None:
    # --no-plots was dropped, and without --capacity two spaces stood before --out.
    args = _report_args("--no-plots", "--loads", "0.5", "--out", "my report")
    line = reproduce_command(args, (0.5, 1.0, 1.5), ("fcfs", "tiered"))
    assert "  " not in line
    assert line.endswith("--no-plots --out 'my report'")
    assert "--capacity" not in line
    args = _report_args("--capacity", "27.88", "--out", "r")
    line = reproduce_command(args, (1.0, 1.5), ("fcfs", "tiered"))
    assert line.endswith("--capacity 27.88 --out r")
    assert "  " not in line


def test_calibrate_measure_says_a_model_path_is_no_directory(tmp_path, capsys) -> None:
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"")
    assert main(_calibrate_measure(tmp_path, "--model", str(model))) == 2
    [error] = capsys.readouterr().err.splitlines()
    # It said the model directory "does not exist", though the path was there.
    assert error.endswith(f"model directory '{model}' is not a directory")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_calibrate_names_an_out_it_could_not_write(tmp_path, capsys) -> None:
    truth = replace(load_preset("cpu-tiny"), overhead_s=0.006)
    samples = _write_samples(tmp_path, truth, [StepShape(n, n * 100) for n in (1, 2, 4, 8)])
    assert main(["calibrate", "--samples", str(samples), "--out", "/dev/full"]) == 2
    # "error: [Errno 28] No space left on device" named no file.
    assert capsys.readouterr().err.splitlines() == [
        "error: --out /dev/full cannot be written: No space left on device"
    ]
