"""`tiergate simulate`: what-if runs, the policy report, presets and calibration.

The gateway's CLI registers this with `add_simulate_parser(subparsers)` and dispatches
to `run(args)`; `python -m scheduler.sim.cli ...` runs it standalone.

    tiergate simulate run --policy tiered --rate 30 --duration 60
    tiergate simulate report --out sim-report
    tiergate simulate presets [NAME]
    tiergate simulate calibrate --samples steps.jsonl --base cpu-tiny --out mine.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from scheduler.sim.admission import INVALID_REQUEST
from scheduler.sim.cost_model import (
    DEFAULT_MAX_MODEL_LEN,
    PRESETS,
    CostModelError,
    RooflineParams,
    fit_roofline,
    load_params,
    load_preset,
    read_samples_file,
    save_params,
)
from scheduler.sim.fleet import POLICIES, FleetSpec, SimOptions, SimulationError, simulate
from scheduler.sim.suites import SUITES
from scheduler.sim.targets import TargetConfig, check_offered_requests, run_experiment
from scheduler.sim.workload import WorkloadError, WorkloadSpec, three_tier_mix

DEFAULT_PRESET = "h200-llama-3.1-8b"


# Arrivals one `run` (or one whole `report`) may offer: an hour at 1,000 requests/s is
# 3.6 M; a typo's 10^9 requests/s would otherwise generate arrivals until memory runs out.
MAX_OFFERED_REQUESTS = 50_000_000
# Simulated seconds (arrivals + drain) of one run. The fleet samples every simulated
# second however idle it is (~13 µs and ~0.7 kB of trace each): a week is seconds of
# wall time and ~0.5 GB, a typo's 10^9 s would run for hours and exhaust memory.
MAX_SIMULATED_S = 7 * 24 * 3600.0
# KV blocks of the whole fleet: the simulated block managers hold an object per block
# (~140 bytes: 8 M is ~1.2 GB; 64 H200 engines are 3 M); and engines, each a step
# scheduler the fleet visits every sample.
MAX_FLEET_KV_BLOCKS = 2**23
MAX_ENGINES = 4096


def _number(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}")
    return value


def positive(text: str) -> float:
    return _number(text, allow_zero=False)


def non_negative(text: str) -> float:
    return _number(text, allow_zero=True)


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas: {text!r}") from exc
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError("expected positive finite numbers")
    return values


def _names(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
        return names

    return parse


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `simulate` (with its own subcommands) to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "simulate",
        help="discrete-event simulation of the real policy at fleet scale",
        description="Run the real queue policy and engine step scheduler on a virtual clock.",
    )
    # `func` is how the gateway's CLI dispatches a parsed command.
    parser.set_defaults(func=run)
    sub = parser.add_subparsers(dest="simulate_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--preset", default=DEFAULT_PRESET, help=f"one of {', '.join(PRESETS)}, or a JSON file"
        )
        p.add_argument("--engines", type=int, default=1, help="number of simulated engines")
        p.add_argument("--duration", type=positive, default=60.0, help="seconds of arrivals")
        p.add_argument("--seed", type=int, default=0)

    one = sub.add_parser("run", help="one policy, one load, per-tier numbers")
    common(one)
    one.add_argument("--policy", choices=POLICIES, default="tiered")
    one.add_argument("--rate", type=positive, required=True, help="offered requests per second")
    one.add_argument(
        "--drain", type=non_negative, default=120.0, help="seconds to run after arrivals stop"
    )
    one.add_argument(
        "--max-tokens",
        type=int,
        help="the max_tokens every client asks: requests stop early at their drawn lengths "
        "(default: each asks exactly its length)",
    )
    one.add_argument("--json", action="store_true", help="print JSON instead of a table")
    one.add_argument(
        "--fast-forward", action="store_true", help="jump over pure-decode stretches (big fleets)"
    )

    rep = sub.add_parser(
        "report", help="all policies over a load sweep, the suites and the targets"
    )
    common(rep)
    rep.add_argument(
        "--loads", type=_floats, default=(0.5, 0.7, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0)
    )
    rep.add_argument("--policies", type=_names(POLICIES), default=POLICIES)
    rep.add_argument("--suites", type=_names(SUITES), default=SUITES)
    rep.add_argument("--suite-duration", type=positive, default=40.0)
    rep.add_argument(
        "--capacity", type=positive, default=None, help="1.0x in requests/s (skips the search)"
    )
    rep.add_argument("--drain", type=non_negative, default=120.0)
    rep.add_argument("--out", type=Path, default=Path("sim-report"))
    rep.add_argument("--no-plots", action="store_true")

    pre = sub.add_parser("presets", help="list the presets, or print one as JSON")
    pre.add_argument("name", nargs="?", choices=PRESETS)

    cal = sub.add_parser("calibrate", help="fit overhead and efficiencies to measured steps")
    source = cal.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--samples", type=Path, help="JSON lines: num_batched_tokens, num_kv_tokens, step_s"
    )
    source.add_argument(
        "--measure", action="store_true", help="time the real engine's steps on this machine"
    )
    cal.add_argument("--model", default="tiny-random", help="with --measure: the model to run")
    cal.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="cpu", help="with --measure"
    )
    cal.add_argument(
        "--save-samples", type=Path, help="with --measure only: also write the samples"
    )
    cal.add_argument(
        "--base", default="cpu-tiny", help="preset or file giving the hardware numbers"
    )
    cal.add_argument("--out", type=Path, required=True)
    # argparse names a missing subcommand by its dest ("simulate_command"); name the
    # commands instead, as the usage line does.
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    return parser


def run(args: argparse.Namespace) -> int:
    """Execute a parsed `simulate` command; returns the process exit status."""
    try:
        if args.simulate_command == "presets":
            return _presets(args)
        if args.simulate_command == "calibrate":
            return _calibrate(args)
        if args.simulate_command == "run":
            if args.rate * args.duration > MAX_OFFERED_REQUESTS:
                print(
                    f"error: --rate x --duration offers {args.rate * args.duration:.3g} "
                    f"requests; a run takes at most {MAX_OFFERED_REQUESTS:,}",
                    file=sys.stderr,
                )
                return 2
            return _run_one(args)
        if args.simulate_command == "report":
            return _report(args)
    except BrokenPipeError:
        raise  # the reader of the output left: the caller's to end quietly
    except (CostModelError, SimulationError, WorkloadError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"error: unknown command {args.simulate_command!r}", file=sys.stderr)
    return 2


def _presets(args: argparse.Namespace) -> int:
    if args.name:
        print(json.dumps(load_preset(args.name).to_dict(), indent=2))
    else:
        for name in PRESETS:
            print(f"{name}: {load_preset(name).description}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if args.save_samples and not args.measure:
        # The samples are the --samples file already; silently writing nothing misled.
        raise SimulationError("--save-samples goes with --measure, not --samples")
    if args.out.resolve() in {p.resolve() for p in (args.samples, args.save_samples) if p}:
        # The preset would overwrite the samples it was fitted on.
        raise SimulationError("--out must not be the samples file")
    base = load_params(args.base)
    # A measurement takes a minute or more: an output it cannot write is said first.
    _check_writable(args.out, "--out")
    if args.save_samples:
        _check_writable(args.save_samples, "--save-samples")
    if args.measure:
        from scheduler.sim.calibrate import calibrate_engine, write_samples

        try:
            # The fit also takes the measured engine's limits (KV blocks, batch sizes).
            result, samples = calibrate_engine(base, args.model, device=args.device)
        except EngineError as exc:
            # A model or device this machine cannot load is the user's input, not a crash.
            print(f"error: --model {args.model} on --device {args.device}: {exc}", file=sys.stderr)
            return 2
        if args.save_samples:
            write_samples(samples, args.save_samples)
    else:
        result = fit_roofline(base, read_samples_file(args.samples))
    try:
        save_params(result.params, args.out)
    except OSError as exc:
        # _check_writable opened it; writing can still fail (a full disk, /dev/full).
        raise SimulationError(
            f"--out {args.out} cannot be written: {exc.strerror or exc}"
        ) from None
    p = result.params
    print(
        f"fitted {result.num_samples} steps: overhead {p.overhead_s * 1000:.3f} ms, "
        f"memory efficiency {p.memory_efficiency:.3f}, compute efficiency "
        f"{p.compute_efficiency:.3f}; mean error {result.mean_abs_rel_error:.1%} -> {args.out}"
    )
    for number in ("memory_bandwidth_bytes_per_s", "peak_flops_per_s"):
        given, fitted = getattr(base, number), getattr(p, number)
        if fitted > given:
            # The steps ran faster than the base allows even at full efficiency.
            print(
                f"note: the steps ran faster than --base's {number} ({given:.4g}) allows; "
                f"the fit raised it to {fitted:.4g} at efficiency 1",
                file=sys.stderr,
            )
    return 0


def _check_writable(path: Path, flag: str) -> None:
    """Open `path` for writing (and remove it again if it was not there), so that an
    output the command cannot write fails before its work rather than after it."""
    if path.is_dir():
        raise SimulationError(f"{flag} {path} is a directory")
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise SimulationError(f"{flag} {path} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        path.unlink()


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise SimulationError(f"--{name.replace('_', '-')} must be > 0")


def _check_scale(args: argparse.Namespace, params: RooflineParams, *durations: str) -> None:
    """Refuse a fleet or a stretch of simulated time that would run for hours or exhaust
    memory, before building anything."""
    if args.engines > MAX_ENGINES:
        raise SimulationError(f"--engines must be at most {MAX_ENGINES:,}")
    if args.engines * params.num_kv_blocks > MAX_FLEET_KV_BLOCKS:
        raise SimulationError(
            f"--engines x num_kv_blocks is {args.engines * params.num_kv_blocks:,} blocks; "
            f"a simulated fleet holds at most {MAX_FLEET_KV_BLOCKS:,}"
        )
    for name in durations:
        if getattr(args, name) + args.drain > MAX_SIMULATED_S:
            flag = "--" + name.replace("_", "-")
            raise SimulationError(
                f"{flag} + --drain is {getattr(args, name) + args.drain:.3g} simulated "
                f"seconds; a run simulates at most {MAX_SIMULATED_S:,.0f} (a week)"
            )


def _run_one(args: argparse.Namespace) -> int:
    _positive(args, "engines", "duration", "rate")
    params = load_params(args.preset)
    _check_scale(args, params, "duration")
    if args.max_tokens is not None:
        # Every request asks it: past the context, the engine (the gateway, in production)
        # refuses every one of them, and the run would measure nothing.
        longest = DEFAULT_MAX_MODEL_LEN - 1
        if not 0 < args.max_tokens <= longest:
            raise SimulationError(
                f"--max-tokens must be between 1 and {longest:,} (the simulated "
                f"context of {DEFAULT_MAX_MODEL_LEN:,} tokens less a prompt token)"
            )
    spec = three_tier_mix(args.rate, args.duration, seed=args.seed, max_tokens=args.max_tokens)
    started = time.perf_counter()
    options = SimOptions(drain_s=args.drain, fast_forward=args.fast_forward)
    result = simulate(spec, args.policy, FleetSpec(params, args.engines), options)
    stats = result.stats
    _note_refused_for_the_cache(spec, params, stats)
    if args.json:
        print(json.dumps(stats.to_dict(), indent=2))
        return 0
    print(
        f"{args.policy} on {args.engines} x {params.name}, "
        f"{args.rate:g} req/s for {args.duration:g} s: "
        f"{stats.output_tokens_per_s:.0f} output tokens/s while arrivals ran, "
        f"{stats.num_preemptions} preemptions, "
        f"{stats.num_steps} steps in {time.perf_counter() - started:.1f} s wall"
    )
    heads = ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    print(
        f"{'tier':12} {'offered':>8} {'attain':>7} {'unfinished':>10} "
        + " ".join(f"{h:>9}" for h in heads),
        " refused; dropped after admission",
    )
    for name, t in sorted(stats.tiers.items()):

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f}"

        att = "-" if t.attainment is None else f"{t.attainment:.1%}"
        print(
            f"{name:12} {t.num_offered:>8} {att:>7} {t.num_unfinished:>10} "
            f"{ms(t.ttft_p50_ms):>9} {ms(t.ttft_p99_ms):>9} "
            f"{ms(t.tpot_p50_ms):>9} {ms(t.tpot_p99_ms):>9}  "
            f"{t.rejections or '-'}; {t.dropped or '-'}"
        )
    return 0


def _note_refused_for_the_cache(spec: WorkloadSpec, params: RooflineParams, stats: Any) -> None:
    """Say on stderr when the engine refused requests as too long: with a small cache
    that is a property of the preset, not of the policy, and easy to misread."""
    num_refused = sum(t.dropped.get(INVALID_REQUEST, 0) for t in stats.tiers.values())
    if not num_refused:
        return
    longest = max(t.prompt_len.high + (t.max_tokens or t.output_len.high) for t in spec.tiers)
    if longest > DEFAULT_MAX_MODEL_LEN:
        print(
            f"note: the engine refused {num_refused} requests as {INVALID_REQUEST}: their "
            f"prompt + max_tokens exceeds the simulated context of {DEFAULT_MAX_MODEL_LEN:,} "
            "tokens (a real gateway answers them 400 context_length_exceeded)",
            file=sys.stderr,
        )
        return
    # The last sampled token is never fed back, so its KV is never stored.
    needed = -(-(longest - 1) // params.block_size)
    if needed <= params.num_kv_blocks:
        return  # the cache holds every request: they were refused for something else
    print(
        f"note: the engine refused {num_refused} requests as {INVALID_REQUEST}: longer than "
        f"its KV cache of {params.num_kv_blocks * params.block_size:,} tokens "
        f"(num_kv_blocks x block_size); the workload's longest takes {needed:,} blocks",
        file=sys.stderr,
    )


def _report(args: argparse.Namespace) -> int:
    from scheduler.sim.report import report_paths, write_report

    # --drain 0 is allowed, as in `run`: requests unfinished at the end count as misses.
    _positive(args, "engines", "duration", "suite_duration")
    params = load_params(args.preset)
    _check_scale(args, params, "duration", "suite_duration")
    config = TargetConfig(
        params,
        num_engines=args.engines,
        duration_s=args.duration,
        drain_s=args.drain,
        load_factors=tuple(sorted(set(args.loads) | {1.0, 1.5})),
        seed=args.seed,
        suite_duration_s=args.suite_duration,
        policies=tuple(dict.fromkeys(("fcfs", "tiered", *args.policies))),
        capacity_rate_per_s=args.capacity,
    )
    if args.capacity is not None:
        # Without it, run_experiment checks as its capacity search narrows 1.0x down.
        check_offered_requests(config, args.capacity, args.suites, MAX_OFFERED_REQUESTS)
    plots = not args.no_plots
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise SimulationError("plots need matplotlib (pip install 'tiergate[sim]'), or --no-plots")
    # The sweep takes minutes: an --out it cannot write is said before it, not after.
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SimulationError(
            f"--out {args.out} is not a directory that can be written: {exc.strerror or exc}"
        ) from None
    for path in report_paths(args.out, plots=plots):
        _check_writable(path, "--out")
    started = time.perf_counter()
    experiment = run_experiment(
        config,
        suites=args.suites,
        on_progress=lambda msg: print(msg, file=sys.stderr, flush=True),
        max_offered_requests=MAX_OFFERED_REQUESTS,
    )
    command = reproduce_command(args, config.load_factors, config.policies)
    paths = write_report(experiment, args.out, command=command, plots=plots)
    for target in experiment.targets:
        why = f"  (n/a: {target.reason})" if target.reason else ""
        print(f"target {target.number}: {target.verdict}  {target.value}{why}")
    print(f"wrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - started:.0f} s")
    return 0


def reproduce_command(
    args: argparse.Namespace, load_factors: tuple[float, ...], policies: tuple[str, ...]
) -> str:
    """The `report` command line that makes the same report (the loads and policies as
    the report ran them: 1.0x, 1.5x, fcfs and tiered are always added)."""
    parts = [
        "tiergate simulate report",
        f"--preset {shlex.quote(str(args.preset))} --engines {args.engines}",
        f"--duration {args.duration:g} --drain {args.drain:g} --seed {args.seed}",
        "--loads " + ",".join(f"{x:g}" for x in load_factors),
        "--policies " + ",".join(policies),
        "--suites " + ",".join(args.suites) + f" --suite-duration {args.suite_duration:g}",
    ]
    if args.capacity:
        parts.append(f"--capacity {args.capacity:g}")
    if args.no_plots:
        parts.append("--no-plots")
    parts.append(f"--out {shlex.quote(str(args.out))}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """`python -m scheduler.sim.cli run ...` is `tiergate simulate run ...`."""
    parser = argparse.ArgumentParser(prog="tiergate")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    args = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(["simulate", *args]))


if __name__ == "__main__":
    raise SystemExit(main())
