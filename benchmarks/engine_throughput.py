"""Engine throughput against transformers, same machine, same model, same prompts.

    python -m benchmarks.engine_throughput --quick --threads 1   # minutes on 2 CPU cores
    python -m benchmarks.engine_throughput --threads 2           # the full workload

Model: a random Llama checkpoint, 8 layers x hidden 512 (written with save_pretrained).
Workload: mixed prompt lengths (uniform) and output lengths 16..512 tokens drawn
log-uniformly (long-tailed, as in real traffic: the distribution's median is ~90
tokens, its mean ~143, its top decile above ~360), ignore_eos, greedy. One batch size
(max_num_seqs) bounds all three.
Compared, each generating exactly the requested tokens of every request:
  (a) transformers `generate` in static batches (a batch runs to its longest output),
  (b) transformers continuous batching (`generate_batch`'s manager, num_blocks and
      max_batch_tokens pinned to our KV cache and step budget, per-request lengths),
  (c) this engine (`engine.LLM`).
Also: time to first token of a short request that arrives while a 2,000-token prompt
is being prefilled, with and without chunked prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.models import write_random_checkpoint

BLOCK_SIZE = 16
NUM_LAYERS, HIDDEN_SIZE, NUM_HEADS, NUM_KV_HEADS = 8, 512, 8, 4


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class Timing:
    """Wall time, and CPU time of the whole process (all its threads): on a shared
    machine the CPU time is the fairer figure, since others' load inflates wall time."""

    wall_s: float
    cpu_s: float


class _Stopwatch:
    def __init__(self) -> None:
        self._wall_s = time.perf_counter()
        self._cpu_s = time.process_time()

    def stop(self) -> Timing:
        return Timing(time.perf_counter() - self._wall_s, time.process_time() - self._cpu_s)


MIN_PROMPT_LEN = MIN_OUTPUT_LEN = 16


def make_workload(num_requests: int, max_prompt_len: int, max_output_len: int, vocab: int):
    """Prompt lengths uniform in [16, max_prompt_len]; output lengths log-uniform in
    [16, max_output_len] (every doubling of the length is equally likely)."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(4, vocab) for _ in range(rng.randint(MIN_PROMPT_LEN, max_prompt_len))]
        for _ in range(num_requests)
    ]
    low, high = math.log(MIN_OUTPUT_LEN), math.log(max_output_len + 1)
    output_lens = [
        min(max_output_len, int(math.exp(rng.uniform(low, high)))) for _ in range(num_requests)
    ]
    return Workload(prompts, output_lens)


def describe_lengths(lengths: list[int]) -> str:
    ordered = sorted(lengths)

    def percentile(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return (
        f"min {ordered[0]}, p25 {percentile(0.25)}, median {percentile(0.5)}, "
        f"mean {statistics.fmean(ordered):.0f}, p90 {percentile(0.9)}, max {ordered[-1]}"
    )


def run_hf_static(model, workload: Workload, batch_size: int) -> Timing:
    """Static batches in arrival order; a batch decodes until its longest request ends."""
    stopwatch = _Stopwatch()
    for i in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[i : i + batch_size]
        longest = max(map(len, prompts))
        ids = torch.tensor([[1] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        max_new = max(workload.output_lens[i : i + batch_size])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=1
            )
        if out.shape[1] != longest + max_new:
            raise RuntimeError("transformers stopped early; eos was not disabled")
    return stopwatch.stop()


def run_hf_continuous(model, workload: Workload, num_blocks: int, max_batch_tokens: int) -> Timing:
    config = transformers.ContinuousBatchingConfig(
        num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, block_size=BLOCK_SIZE
    )
    generation_config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max(workload.output_lens), pad_token_id=1
    )
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=config
    )
    stopwatch = _Stopwatch()
    manager.start()
    try:
        ids = [
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
            for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        generated: dict[str, int] = {}
        while len(generated) < len(ids):
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if result.is_finished():
                generated[result.request_id] = len(result.generated_tokens)
        num_tokens = sum(generated.values())
    finally:
        manager.stop(block=True)
    timing = stopwatch.stop()
    if num_tokens != workload.num_output_tokens:
        raise RuntimeError(f"transformers CB generated {num_tokens} tokens, not the workload's")
    return timing


def run_engine(checkpoint: Path, workload: Workload, args) -> tuple[Timing, LLM]:
    llm = LLM(
        str(checkpoint),
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_cache_bytes=args.kv_blocks * BLOCK_SIZE * _kv_bytes_per_token(),
    )
    llm.generate([[5] * 8], SamplingParams(max_tokens=2))  # warm up
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    stopwatch = _Stopwatch()
    outputs = llm.generate(workload.prompts, params)
    timing = stopwatch.stop()
    if sum(o.num_output_tokens for o in outputs) != workload.num_output_tokens:
        raise RuntimeError("the engine did not generate the workload's tokens")
    return timing, llm


def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def _kv_bytes_per_token() -> int:
    return 2 * NUM_LAYERS * NUM_KV_HEADS * (HIDDEN_SIZE // NUM_HEADS) * 4


async def _ttft_once(engine: AsyncEngine, long_prompt: list[int], delay_s: float) -> float:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long_stream = engine.generate(long_prompt, params)
    long_task = asyncio.create_task(_drain(long_stream))
    await asyncio.sleep(delay_s)  # the long prompt's prefill is under way
    arrived_s = time.perf_counter()
    short = engine.generate([7] * 16, params)
    await anext(short)
    ttft_s = time.perf_counter() - arrived_s
    await short.aclose()
    await long_task
    return ttft_s


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def measure_ttft(checkpoint: Path, *, chunked: bool, long_len: int, repeats: int) -> float:
    config = EngineConfig(
        model=str(checkpoint),
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_model_len=long_len + 64,
        max_num_batched_tokens=512 if chunked else long_len + 64,
        max_prefill_chunk_tokens=256,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,  # each repeat must prefill the long prompt again
    )
    engine = AsyncEngine(config)
    engine.start()
    rng = random.Random(1)
    long_prompt = [rng.randrange(4, 800) for _ in range(long_len)]

    async def main() -> list[float]:
        await _drain(engine.generate([5] * 8, SamplingParams(max_tokens=2)))  # warm up
        return [await _ttft_once(engine, long_prompt, 0.05) for _ in range(repeats)]

    try:
        samples = asyncio.run(main())
    finally:
        engine.shutdown()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="batch size, all three")
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--skip-hf-continuous", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # Three times more requests than batch slots: requests come and go, as in serving.
    # Batch 16 keeps a 2-core CPU's decode step memory-bound rather than overloaded.
    if args.quick:
        num_requests, max_prompt, max_output, batch = 48, 128, 512, 16
    else:
        num_requests, max_prompt, max_output, batch = 96, 256, 512, 16
    args.max_num_seqs = args.max_num_seqs or batch
    args.kv_blocks = args.max_num_seqs * (max_prompt + max_output) // BLOCK_SIZE + 8

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_random_checkpoint(
            tmp,
            num_layers=NUM_LAYERS,
            hidden_size=HIDDEN_SIZE,
            num_heads=NUM_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            max_position_embeddings=4096,
            seed=0,
        )
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32
        ).eval()
        hf.generation_config.eos_token_id = None  # ignore_eos for transformers
        workload = make_workload(num_requests, max_prompt, max_output, hf.config.vocab_size)
        total = workload.num_output_tokens
        print(
            f"workload: {num_requests} requests, {total} generated tokens, torch threads "
            f"{torch.get_num_threads()}, batch {args.max_num_seqs} (all three), "
            f"step budget {args.max_batched_tokens} tokens, KV {args.kv_blocks} blocks\n"
            f"  prompt lengths uniform {MIN_PROMPT_LEN}..{max_prompt}: "
            f"{describe_lengths([len(p) for p in workload.prompts])}\n"
            f"  output lengths log-uniform {MIN_OUTPUT_LEN}..{max_output}: "
            f"{describe_lengths(workload.output_lens)}\n"
            f"  load average before: {_load_average()}"
        )
        results: dict[str, Timing] = {}
        engine_timing, llm = run_engine(checkpoint, workload, args)
        results["(c) tiergate engine"] = engine_timing
        stats = llm.engine.stats()
        del llm
        results["(a) transformers generate, static batches"] = run_hf_static(
            hf, workload, args.max_num_seqs
        )
        if not args.skip_hf_continuous:
            results["(b) transformers continuous batching"] = run_hf_continuous(
                hf, workload, args.kv_blocks, args.max_batched_tokens
            )
        print(f"{'':45s} {'wall s':>8s} {'tokens/s':>9s} {'CPU s':>8s} {'tokens/CPU s':>12s}")
        for name, t in sorted(results.items()):
            print(
                f"{name:45s} {t.wall_s:8.2f} {total / t.wall_s:9.1f} "
                f"{t.cpu_s:8.2f} {total / t.cpu_s:12.1f}"
            )
        for name, t in sorted(results.items()):
            if not name.startswith("(c)"):
                print(
                    f"ratio (c) / {name[:3]}: {t.wall_s / engine_timing.wall_s:.2f}x wall, "
                    f"{t.cpu_s / engine_timing.cpu_s:.2f}x CPU time"
                )
        print(f"engine: {stats.num_steps} steps, {stats.num_preemptions} preemptions")
        print(f"load average after: {_load_average()}")

        long_len = 2000
        repeats = 2 if args.quick else 3
        chunked = measure_ttft(checkpoint, chunked=True, long_len=long_len, repeats=repeats)
        whole = measure_ttft(checkpoint, chunked=False, long_len=long_len, repeats=repeats)
        print(
            f"TTFT of a 16-token request arriving during a {long_len}-token prefill: "
            f"{chunked * 1000:.0f} ms with chunked prefill (256-token chunks), "
            f"{whole * 1000:.0f} ms without ({whole / chunked:.1f}x)"
        )


if __name__ == "__main__":
    main()
