"""The shape of a decoder checkpoint, read from its config.json.

Plain Python (no torch): the loader, the KV sizing and the tests all read the same
frozen description.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModelError

# Architectures that share the Llama block: RMSNorm, rotary attention with GQA, SwiGLU.
# Qwen2 adds a bias on q/k/v; Qwen3 adds an RMSNorm on each head of q and k.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def read_config(checkpoint_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{checkpoint_dir} has no config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"config.json in {checkpoint_dir} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"config.json in {checkpoint_dir} is not a JSON object")
    return data


def arch_from_config(data: dict[str, Any]) -> ModelArch:
    """Validate a Hugging Face config dict and describe the model it defines."""
    architectures = data.get("architectures") or [data.get("model_type", "<none>")]
    architecture = str(architectures[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(architecture, SUPPORTED_ARCHITECTURES)
    try:
        num_heads = int(data["num_attention_heads"])
        hidden_size = int(data["hidden_size"])
        head_dim = data.get("head_dim") or hidden_size // num_heads
        sliding = data.get("sliding_window")
        if architecture.startswith("Qwen") and not data.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window they do not use
        arch = ModelArch(
            architecture=architecture,
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(data.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_config(data),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(data.get("attention_bias")),
            qk_norm=architecture == "Qwen3ForCausalLM",
            mlp_bias=bool(data.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json is missing or has a bad field: {exc!r}") from exc
    if arch.num_heads % arch.num_kv_heads != 0 or arch.head_dim % 2 != 0:
        raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
    hidden_act = data.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelLoadError(f"hidden_act {hidden_act!r} is not supported (only silu)")
    return arch


def _rope_from_config(data: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type={rope_type}", SUPPORTED_ROPE_TYPES)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
