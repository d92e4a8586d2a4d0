"""`python -m engine.demo`: load a model, complete a few prompts, print tokens/s.

The built-in tiny-random model's text is noise; the point is the plumbing and the rate.
"""

from __future__ import annotations

import argparse
import time

from engine.config import TINY_RANDOM
from engine.llm import LLM
from engine.request import SamplingParams

PROMPTS = [
    "The gateway decides who is served next because",
    "Once upon a time there was a small model",
    "def generate(prompt, max_tokens=16):",
    "Paged KV caches let sequences share a prompt prefix:",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=TINY_RANDOM, help="checkpoint dir or tiny-random")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    llm = LLM(args.model, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
    started_s = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    elapsed_s = time.perf_counter() - started_s
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        print(f"{prompt!r} -> {output.text!r} ({output.finish_reason})")
    num_generated = sum(o.num_output_tokens for o in outputs)
    print(
        f"{num_generated} tokens in {elapsed_s:.2f} s: "
        f"{num_generated / elapsed_s:.1f} generated tokens/s on {llm.engine.runner.device}"
    )


if __name__ == "__main__":
    main()
