"""`tiergate simulate` through its argparse entry point."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from scheduler.sim.cli import main
from scheduler.sim.cost_model import StepShape, load_params, load_preset


def test_presets_and_run(capsys) -> None:
    assert main(["presets"]) == 0
    assert "h200-llama-3.1-8b" in capsys.readouterr().out
    assert main(["presets", "cpu-tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "cpu-tiny"
    assert main(["run", "--policy", "fcfs", "--rate", "5", "--duration", "5", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tiers"]["interactive"]["num_offered"] > 0


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


def test_a_run_too_large_to_generate_is_refused_up_front(capsys) -> None:
    # 5e9 arrivals would be generated before the first step: refused at once instead.
    assert main(["run", "--rate", "1e9", "--duration", "5"]) == 2
    assert "at most" in capsys.readouterr().err


def test_calibrate_writes_a_fitted_parameter_file(tmp_path, capsys) -> None:
    truth = replace(load_preset("cpu-tiny"), overhead_s=0.006, memory_efficiency=0.3)
    rng = random.Random(3)
    lines = []
    for _ in range(60):
        batch = rng.choice([1, 4, 16, 64, 256, 1024])
        shape = StepShape(batch, batch * rng.randint(1, 200))
        row = {"num_batched_tokens": shape.num_batched_tokens, "num_kv_tokens": shape.num_kv_tokens}
        lines.append(json.dumps({**row, "step_s": truth.shape_time_s(shape)}))
    samples = tmp_path / "steps.jsonl"
    samples.write_text("\n".join(lines))
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
