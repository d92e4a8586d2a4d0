"""Measure step times of the real engine, to fit the roofline for the machine at hand.

The engine (and with it torch) is imported only when a measurement runs, so the rest of
the simulator stays importable anywhere. Each sample is one `LLMEngine.step()`: the
plan the step scheduler produced (its shape) and the wall time of the whole step,
scheduling and post-processing included, since the simulated step stands for all of it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from scheduler.sim.cost_model import StepSample, StepShape, chunk_shape


def measure_engine_steps(
    model: str = "tiny-random",
    *,
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1, 4, 16, 32),
    prompt_lens: Sequence[int] = (16, 128, 512),
    max_tokens: int = 24,
    seed: int = 0,
) -> list[StepSample]:
    """Run batches of requests through a real engine and time every step."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=model, device=device, max_num_seqs=max(batch_sizes), seed=seed)
    )
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    plans = []

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        plans.append(plan)
        return plan

    # Instrumentation, not a substitute: the real schedule() runs and we keep its plan.
    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    samples: list[StepSample] = []
    # One unmeasured request first: the first forward passes pay for lazy setup.
    engine.add_request("cal-warm-up", [5] * 8, params)
    while engine.has_unfinished():
        engine.step()
    n = 0
    for prompt_len in prompt_lens:
        for batch in batch_sizes:
            for _ in range(batch):
                n += 1
                prompt = [rng.randrange(4, engine.vocab_size) for _ in range(prompt_len)]
                engine.add_request(f"cal-{n}", prompt, params)
            while engine.has_unfinished():
                plans.clear()
                started = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - started
                if not plans or plans[-1].is_empty:
                    continue
                samples.append(StepSample(plan_shape(plans[-1].chunks), elapsed))
    return samples


def plan_shape(chunks: Iterable) -> StepShape:  # type: ignore[type-arg]
    """The roofline's view of a step plan's chunks."""
    tokens = kv = 0
    pairs = 0.0
    for chunk in chunks:
        chunk_kv, chunk_pairs = chunk_shape(chunk.start, chunk.num_tokens)
        tokens += chunk.num_tokens
        kv += chunk_kv
        pairs += chunk_pairs
    return StepShape(tokens, kv, pairs)


def write_samples(samples: Iterable[StepSample], path: Path) -> None:
    """JSON lines, the format `read_samples` (and `calibrate --samples`) reads."""
    with path.open("w", encoding="utf-8") as f:
        for s in samples:
            row = {
                "num_batched_tokens": s.shape.num_batched_tokens,
                "num_kv_tokens": s.shape.num_kv_tokens,
                "num_attention_pairs": s.shape.num_attention_pairs,
                "step_s": s.step_s,
            }
            f.write(json.dumps(row) + "\n")
