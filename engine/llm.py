"""The offline API: `LLM(model).generate(prompts, params)`.

from engine import LLM, SamplingParams
llm = LLM("tiny-random")
outputs = llm.generate(["Hello", "The gateway"], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import TINY_RANDOM, EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request import SamplingParams

__all__ = ["LLM", "RequestOutput"]

Prompt = str | Sequence[int]


class LLM:
    """Runs batches of prompts to completion on an in-process engine."""

    def __init__(self, model: str = TINY_RANDOM, *, device: str = "auto", **overrides: Any):
        self.engine = LLMEngine(EngineConfig(model=model, device=device, **overrides))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come in input order.

        A bad prompt raises its typed error before anything runs.
        """
        batch = _as_batch(prompts)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        return self._run(token_lists, params)

    def chat(
        self,
        conversations: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"}) or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        token_lists = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self._run(token_lists, params)

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(token_lists)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(token_lists):
                raise ValueError("pass one SamplingParams, or one per prompt")
        for tokens, p in zip(token_lists, per_prompt, strict=True):
            self.engine.validate(tokens, p)
        request_ids = [str(next(self._ids)) for _ in token_lists]
        for request_id, tokens, p in zip(request_ids, token_lists, per_prompt, strict=True):
            self.engine.add_request(request_id, tokens, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            if not self.engine.has_unfinished():
                raise RuntimeError("the engine dropped requests without finishing them")
            for output in self.engine.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[request_id] for request_id in request_ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if len(prompts) > 0 and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]
