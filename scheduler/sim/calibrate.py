"""Measure step times of the real engine, to fit the roofline for the machine at hand.

The engine (and with it torch) is imported only when a measurement runs, so the rest of
the simulator stays importable anywhere. Each sample is one `LLMEngine.step()`: the
plan the step scheduler produced (its shape) and the wall time of the whole step,
scheduling and post-processing included, since the simulated step stands for all of it.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from scheduler.sim.cost_model import (
    FitResult,
    RooflineParams,
    StepSample,
    StepShape,
    chunk_shape,
    fit_roofline,
)


def build_engine(model: str = "tiny-random", *, device: str = "cpu", seed: int = 0) -> Any:
    """An `LLMEngine` with the configuration a serving process gives it (its limits are
    the ones the simulated engine must have)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, device=device, seed=seed))


def engine_limits(engine: Any) -> dict[str, int]:
    """The capacity limits of a real engine, as `RooflineParams` fields: a cost fit is
    only half of a preset, the simulated step scheduler must batch as the real one."""
    config = engine.config
    return {
        "block_size": config.block_size,
        "num_kv_blocks": engine.block_manager.num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_prefill_chunk_tokens": config.max_prefill_chunk_tokens
        or config.max_num_batched_tokens,
    }


def calibrate_engine(
    base: RooflineParams,
    model: str = "tiny-random",
    *,
    device: str = "cpu",
    **measure: Any,
) -> tuple[FitResult, list[StepSample]]:
    """Time a real engine's steps, fit the roofline, and give the fit the engine's limits."""
    engine = build_engine(model, device=device)
    samples = measure_engine_steps(engine=engine, **measure)
    result = fit_roofline(base, samples)
    params = replace(result.params, **engine_limits(engine))
    return replace(result, params=params), samples


def measure_engine_steps(
    model: str = "tiny-random",
    *,
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1, 4, 16, 32),
    prompt_lens: Sequence[int] = (16, 128, 512),
    max_tokens: int = 24,
    num_staggered: int = 64,
    repeats: int = 3,
    seed: int = 0,
    engine: Any = None,
) -> list[StepSample]:
    """Run requests through a real engine (`engine`, or a new one of `model`) and time
    every step.

    Two phases: batches (each of `batch_sizes` requests of each of `prompt_lens` tokens
    added at once: pure prefill steps, then pure decode steps), then `num_staggered`
    requests that arrive while others decode, as a serving engine sees them (mixed
    steps of decodes and prefill chunks, batches that grow and shrink). The whole
    schedule runs `repeats` times with fresh prompts of the same lengths; the plans are
    the same each time, and each step keeps the median of its times, so that a burst of
    other work on a shared machine does not become the fit.
    """
    from engine.request import SamplingParams

    if engine is None:
        engine = build_engine(model, device=device, seed=seed)
    if max(batch_sizes) > engine.config.max_num_seqs:
        raise ValueError("a calibration batch is larger than the engine's max_num_seqs")
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    plans = []

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        plans.append(plan)
        return plan

    def timed_step() -> tuple[StepShape, float] | None:
        plans.clear()
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        if not plans or plans[-1].is_empty:
            return None
        return plan_shape(plans[-1].chunks), elapsed

    # Instrumentation, not a substitute: the real schedule() runs and we keep its plan.
    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    rng = random.Random(seed)
    # Unmeasured requests first, one per prompt length: the first forward passes of a
    # shape pay for lazy setup.
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, prompt_len in enumerate(prompt_lens):
        prompt = [rng.randrange(4, engine.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"cal-warm-up-{i}", prompt, warm)
    while engine.has_unfinished():
        engine.step()
    arrivals = _staggered_arrivals(num_staggered, prompt_lens, max_tokens, seed)
    ids = itertools.count()

    def add(prompt_len: int, output_len: int) -> None:
        prompt = [rng.randrange(4, engine.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"cal-{next(ids)}", prompt, params)

    runs: list[list[tuple[StepShape, float]]] = []
    for _ in range(repeats):
        steps: list[tuple[StepShape, float]] = []
        for prompt_len in prompt_lens:
            for batch in batch_sizes:
                for _ in range(batch):
                    add(prompt_len, max_tokens)
                while engine.has_unfinished():
                    if (step := timed_step()) is not None:
                        steps.append(step)
        # Staggered: arrivals keyed to step counts (not to time), so every repeat plans
        # the same steps.
        next_arrival = 0
        step_index = 0
        while next_arrival < len(arrivals) or engine.has_unfinished():
            while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= step_index:
                add(*arrivals[next_arrival][1:])
                next_arrival += 1
            step_index += 1
            if engine.has_unfinished() and (step := timed_step()) is not None:
                steps.append(step)
        runs.append(steps)
    return _median_steps(runs)


def _staggered_arrivals(
    num: int, prompt_lens: Sequence[int], max_tokens: int, seed: int
) -> list[tuple[int, int, int]]:
    """(step index, prompt tokens, output tokens) of the staggered phase: a quick run of
    arrivals that builds a large batch, then sparse ones while it drains, prompt lengths
    log-uniform over the range of prompt_lens, outputs up to twice max_tokens."""
    rng = random.Random(f"{seed}:staggered")
    low, high = math.log(min(prompt_lens)), math.log(max(prompt_lens))
    out = []
    step = 0
    for i in range(num):
        step += 1 if i < num // 2 else 6
        prompt_len = round(math.exp(rng.uniform(low, high)))
        out.append((step, prompt_len, rng.randint(max(2, max_tokens // 3), 2 * max_tokens)))
    return out


def _median_steps(runs: list[list[tuple[StepShape, float]]]) -> list[StepSample]:
    """One sample per step: its shape and the median of its times over the repeats."""
    first = runs[0]
    for run in runs[1:]:
        if [shape for shape, _ in run] != [shape for shape, _ in first]:
            # The plans differed (they should not): keep every step as measured.
            return [StepSample(shape, t) for steps in runs for shape, t in steps]
    return [
        StepSample(shape, statistics.median(run[i][1] for run in runs))
        for i, (shape, _) in enumerate(first)
    ]


def plan_shape(chunks: Iterable) -> StepShape:  # type: ignore[type-arg]
    """The roofline's view of a step plan's chunks."""
    tokens = kv = num_seqs = 0
    pairs = 0.0
    for chunk in chunks:
        num_seqs += 1
        chunk_kv, chunk_pairs = chunk_shape(chunk.start, chunk.num_tokens)
        tokens += chunk.num_tokens
        kv += chunk_kv
        pairs += chunk_pairs
    return StepShape(tokens, kv, pairs, num_seqs)


def write_samples(samples: Iterable[StepSample], path: Path) -> None:
    """JSON lines, the format `read_samples` (and `calibrate --samples`) reads."""
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            row = {
                "num_batched_tokens": s.shape.num_batched_tokens,
                "num_kv_tokens": s.shape.num_kv_tokens,
                "num_attention_pairs": s.shape.num_attention_pairs,
                "num_seqs": s.shape.num_seqs,
                "step_s": s.step_s,
            }
            f.write(json.dumps(row) + "\n")


def mean_by_shape(samples: Iterable[StepSample]) -> list[StepSample]:
    """One sample per kind of step: steps of about the same tokens, sequences and KV
    read (exact up to 4, then powers of two) averaged, shape and time.

    Step times measured in service scatter (other work on the machine, the event loop
    sharing the interpreter), and the fit minimises relative error, which on scattered
    samples leans to the short ones: it would predict steps faster than they take on
    average, and the average is what sets throughput and queueing.
    """
    groups: dict[tuple[int, int, int], list[StepSample]] = {}
    for s in samples:
        shape = s.shape
        key = (_bin(shape.num_batched_tokens), _bin(shape.num_seqs), _bin(shape.num_kv_tokens))
        groups.setdefault(key, []).append(s)
    out = []
    for _, group in sorted(groups.items()):
        n = len(group)
        shape = StepShape(
            round(sum(s.shape.num_batched_tokens for s in group) / n),
            round(sum(s.shape.num_kv_tokens for s in group) / n),
            sum(s.shape.attention_pairs for s in group) / n,
            round(sum(s.shape.num_seqs for s in group) / n),
        )
        out.append(StepSample(shape, sum(s.step_s for s in group) / n))
    return out


def _bin(value: int) -> int:
    return value if value <= 4 else 1 << (value - 1).bit_length()
