"""How well the predicted slot releases match the real ones (scheduler.slot_release).

A closed loop of engine slots is simulated token by token: each slot runs a request
whose output length is drawn from a distribution (lognormal of several spreads, or
geometric), capped by max_tokens; a finished request is replaced at once and teaches the
engine's StopHazard its length, as the engine's step does. At regular snapshots, the
expected k-th release predicted from the running requests (their max_tokens left, their
ages, the measured curve) is compared with the real k-th release of that snapshot:

- age curve: the stop hazard per age bucket, as the engine publishes it;
- one hazard: the same estimator with one hazard for every age (a geometric length),
  the baseline measured in the same run;
- age q90: the age curve's 90% quantile (the step by which the slot has freed with
  probability 0.9), whose real releases should come later in about 10% of predictions.

Printed per rank k: the mean real and predicted release (decode steps); the mean of
|predicted - real mean| / real mean over ranks; and how often the real release came
after the predicted one. Then the time one prediction takes for
engines with 8, 64 and 256 running requests.

    python benchmarks/slot_release_accuracy.py [--slots 8] [--steps 300000]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and its sibling benchmarks (named
# like the packages they measure) would shadow the packages; the checkout goes first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from engine.stop_hazard import (  # noqa: E402
    NUM_BUCKETS,
    StopCurve,
    StopHazard,
    age_bucket,
    count_ages,
    new_step_counts,
)
from scheduler.slot_release import release_steps  # noqa: E402

MEAN_TOKENS = 300
MAX_TOKENS = 2048
SNAPSHOT_EVERY = 1999  # steps (prime: no lock-step with the lengths)
WARM_UP_STEPS = 50_000


def _drawer(kind: str, sigma: float, rng: random.Random):
    if kind == "geometric":
        return lambda: max(1, int(rng.expovariate(1 / MEAN_TOKENS)))
    mu = math.log(MEAN_TOKENS) - sigma**2 / 2
    return lambda: max(1, int(rng.lognormvariate(mu, sigma)))


def _learn(hazard: StopHazard, length: int) -> None:
    made = min(length, MAX_TOKENS)
    tokens, stops = new_step_counts(), new_step_counts()
    count_ages(tokens, 0, made)
    if length <= MAX_TOKENS:
        stops[age_bucket(made - 1)] += 1
    hazard.record(tokens, stops)


def accuracy(kind: str, sigma: float, num_slots: int, num_steps: int) -> None:
    rng = random.Random(1)
    draw = _drawer(kind, sigma, rng)
    hazard = StopHazard()
    slots = [[0, draw()] for _ in range(num_slots)]  # (tokens made, length)
    names = ("real", "age curve", "one hazard", "age q90")
    sums = {name: [0.0] * num_slots for name in names}
    # Snapshots whose real k-th release came after the predicted one, per predictor.
    late = {name: [0] * num_slots for name in names}
    num_snapshots = 0
    for step in range(num_steps):
        for slot in slots:
            slot[0] += 1
            if slot[0] >= min(slot[1], MAX_TOKENS):
                _learn(hazard, slot[1])
                slot[0], slot[1] = 0, draw()
        if step < WARM_UP_STEPS or step % SNAPSHOT_EVERY:
            continue
        num_snapshots += 1
        running = [(MAX_TOKENS - made, made, True) for made, _ in slots]
        predicted = {
            "real": sorted(min(length, MAX_TOKENS) - made for made, length in slots),
            "age curve": release_steps(running, hazard.curve),
            "one hazard": release_steps(running, StopCurve([hazard.per_token] * NUM_BUCKETS)),
            "age q90": release_steps(running, hazard.curve, quantile=0.9),
        }
        real = predicted["real"]
        for name, releases in predicted.items():
            for k, value in enumerate(releases):
                sums[name][k] += value
                late[name][k] += real[k] > value
    means = {name: [v / num_snapshots for v in values] for name, values in sums.items()}
    label = "geometric" if kind == "geometric" else f"lognormal sigma {sigma}"
    print(f"\n{label}: {num_slots} slots, mean {MEAN_TOKENS} tokens, {num_snapshots} snapshots")
    columns = (("age curve", 11), ("one hazard", 12), ("age q90", 9))
    print(f"{'k':>3}{'real':>9}" + "".join(f"{name:>{w}}" for name, w in columns))
    for k in range(num_slots):
        row = "".join(f"{means[name][k]:>{w}.0f}" for name, w in columns)
        print(f"{k + 1:>3}{means['real'][k]:>9.0f}{row}")
    for name in ("age curve", "one hazard"):
        errors = [abs(p - r) / r for p, r in zip(means[name], means["real"], strict=True)]
        print(f"{name}: mean error {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}")
    for name in ("age curve", "one hazard", "age q90"):
        share = sum(late[name]) / (num_snapshots * num_slots)
        print(f"{name}: the real release came later in {share:.0%} of predictions")


def timing() -> None:
    rng = random.Random(2)
    hazard = StopHazard()
    draw = _drawer("lognormal", 1.0, rng)
    for _ in range(2_000):
        _learn(hazard, draw())
    curve = hazard.curve
    print("\ntime per prediction (64 releases; the fastest of 5 rounds: the machine is shared):")
    for num_running in (8, 64, 256):
        ages = [rng.randrange(1_000) for _ in range(num_running)]
        running = [(MAX_TOKENS - a, a, True) for a in ages]
        repeat = max(3, 1_000 // num_running)
        for quantile in (None, 0.9):
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(repeat):
                    release_steps(running, curve, quantile=quantile)
                rounds.append((time.perf_counter() - start) / repeat)
            kind = "mean" if quantile is None else f"q{quantile * 100:.0f}"
            print(f"  {num_running:>4} running, {kind:>4}: {min(rounds) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300_000)
    args = parser.parse_args()
    for kind, sigma in (
        ("lognormal", 1.0),
        ("lognormal", 0.6),
        ("lognormal", 0.3),
        ("geometric", 0),
    ):
        accuracy(kind, sigma, args.slots, args.steps)
    timing()


if __name__ == "__main__":
    main()
