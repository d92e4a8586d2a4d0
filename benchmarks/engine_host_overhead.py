"""The engine's host time per step, early in long generations against late in them.

A step's host work (scheduling, appending the sampled tokens, detokenizing, building
each request's output) should not grow with how long the outputs already are: on a GPU
it runs between kernels for every running sequence, and a cost that grows with the
output length makes long generations slower the longer they run. Both figures come from
the same run: the model runner is replaced by a null runner that samples a fixed token
instantly (a benchmark harness, not a product path), so the time measured is the
engine's own. The batch runs `--seqs` sequences to `--tokens` output tokens each; the
mean step time over the last `--window` steps is printed against the mean over the
first `--window` decode steps. Goal: a ratio of at most 1.2.

    python benchmarks/engine_host_overhead.py [--seqs 64] [--tokens 2000] [--window 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and its sibling benchmarks (named
# like the packages they measure) would shadow the packages; the checkout goes first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

PROMPT_TOKENS = 16
TEXT_TOKEN_ID = 300  # a tiny-random id that decodes to text (not end-of-sequence)
GOAL_RATIO = 1.2


class NullRunner:
    """Samples TEXT_TOKEN_ID for every chunk that asks a token, with no model compute."""

    def execute(self, chunks):
        return [TEXT_TOKEN_ID if chunk.produces_token else None for chunk in chunks]


def run(num_seqs: int, num_tokens: int, window: int) -> tuple[float, float]:
    """Mean host seconds per step over the first and the last `window` decode steps."""
    config = EngineConfig(
        model="tiny-random",
        device="cpu",
        max_num_seqs=num_seqs,
        max_model_len=PROMPT_TOKENS + num_tokens,
        kv_cache_bytes=None,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    engine.runner = NullRunner()
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [10 + i % 50] * PROMPT_TOKENS, params)
    times = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        if len(outputs) == num_seqs and all(len(o.new_token_ids) == 1 for o in outputs):
            times.append(elapsed)  # a full decode step of every sequence
    if len(times) < 2 * window:
        raise SystemExit(f"only {len(times)} full decode steps; lower --window")
    return statistics.fmean(times[:window]), statistics.fmean(times[-window:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    early, late = run(args.seqs, args.tokens, args.window)
    ratio = late / early
    print(f"{args.seqs} sequences to {args.tokens} output tokens, null model runner")
    print(f"host time per decode step, first {args.window} steps: {early * 1e3:.3f} ms")
    print(f"host time per decode step, last {args.window} steps:  {late * 1e3:.3f} ms")
    verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
    print(f"late/early: {ratio:.2f} (goal <= {GOAL_RATIO}: {verdict})")


if __name__ == "__main__":
    main()
