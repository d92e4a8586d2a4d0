"""Model definitions and loading: Llama-family decoders over a paged KV cache."""

from __future__ import annotations

from engine.config import TINY_RANDOM
from engine.models.arch import SUPPORTED_ARCHITECTURES, ModelArch
from engine.models.attention import AttentionMetadata
from engine.models.loader import LoadedModel, load_checkpoint
from engine.models.tiny_random import load_tiny_random, write_random_checkpoint

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "LoadedModel",
    "ModelArch",
    "load_model",
    "write_random_checkpoint",
]


def load_model(model: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load `tiny-random` or a Hugging Face checkpoint directory."""
    if model == TINY_RANDOM:
        return load_tiny_random(device, dtype)
    return load_checkpoint(model, device, dtype)
