"""What a gateway without an engine knows about the served model: name, context, tokenizer.

`tiergate gateway` validates and tokenises requests itself, so it loads the model's
tokenizer and reads its config, never its weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer import Tokenizer

TINY_RANDOM = "tiny-random"


@dataclass(frozen=True)
class ModelCard:
    """Satisfies the routes' ModelInfo protocol."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer


def load_model_card(model: str, max_model_len: int | None = None) -> ModelCard:
    """The tokenizer and context length of `model` (a checkpoint directory or tiny-random).

    The context is the model's own, capped by `max_model_len`; a worker whose KV cache
    is smaller still refuses longer requests itself.
    """
    from engine.models.arch import arch_from_config, read_config

    if model == TINY_RANDOM:
        from engine.models.tiny_random import tiny_random_config

        data = tiny_random_config()
    else:
        data = read_config(Path(model))
    arch = arch_from_config(data)
    context = arch.max_position_embeddings
    if arch.sliding_window is not None:
        context = min(context, arch.sliding_window)
    if max_model_len is not None:
        context = min(context, max_model_len)
    return ModelCard(model_name=model, max_model_len=context, tokenizer=Tokenizer(model))
