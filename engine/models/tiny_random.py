"""The built-in `tiny-random` model and random checkpoints for tests and benchmarks.

tiny-random is a small Llama (4 layers, hidden 256, 8 heads, 2 KV heads) whose weights
are drawn from a fixed seed on the CPU when it loads, so every machine gets the same
numbers without shipping a weights file. Its tokenizer ships in engine/assets/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from engine.models.arch import arch_from_config
from engine.models.loader import LoadedModel, build_model, resolve_device, resolve_dtype

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_RANDOM_SEED = 20240229
# Larger than the usual 0.02 so logits are peaked: with near-uniform logits, greedy
# decoding would hinge on float rounding and parity tests would be fragile.
INIT_STD = 0.08


def tokenizer_vocab_size() -> int:
    data = json.loads((ASSETS_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    return len(data["model"]["vocab"]) + sum(
        1 for t in data.get("added_tokens", []) if t["content"] not in data["model"]["vocab"]
    )


def tiny_random_config() -> dict[str, Any]:
    """config.json of tiny-random, in Hugging Face's LlamaConfig vocabulary."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tokenizer_vocab_size(),
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 3,
    }


def load_tiny_random(device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Build tiny-random with weights drawn from TINY_RANDOM_SEED (identical everywhere)."""
    arch = arch_from_config(tiny_random_config())
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model = build_model(arch, torch_device, torch_dtype)
    generator = torch.Generator(device="cpu").manual_seed(TINY_RANDOM_SEED)
    with torch.no_grad():
        # Sorted names fix the draw order; norms start at one, biases at zero, as in HF.
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                is_norm = not name.endswith("bias")
                param.fill_(1.0 if is_norm else 0.0)
                continue
            values = torch.randn(param.shape, generator=generator) * INIT_STD
            param.copy_(values.to(torch_dtype))
    return LoadedModel(model, arch, torch_device, torch_dtype)


def write_random_checkpoint(
    directory: str | Path,
    *,
    architecture: str = "LlamaForCausalLM",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    init_std: float = INIT_STD,
    max_shard_size: str | None = None,
) -> Path:
    """Save a random checkpoint with transformers' own save_pretrained, plus the built-in
    tokenizer, so the engine and transformers can both load it."""
    import transformers

    config_classes = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }
    model_classes = {
        "LlamaForCausalLM": transformers.LlamaForCausalLM,
        "MistralForCausalLM": transformers.MistralForCausalLM,
        "Qwen2ForCausalLM": transformers.Qwen2ForCausalLM,
        "Qwen3ForCausalLM": transformers.Qwen3ForCausalLM,
    }
    kwargs: dict[str, Any] = {
        "vocab_size": tokenizer_vocab_size(),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or hidden_size * 3,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": init_std,
        "bos_token_id": 0,
        "eos_token_id": 3,
        "pad_token_id": 1,
    }
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    config = config_classes[architecture](**kwargs)
    torch.manual_seed(seed)
    model = model_classes[architecture](config).eval()
    if architecture == "Qwen2ForCausalLM":
        # HF initialises biases to zero; random ones make the bias path matter in tests.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, init_std)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS_DIR / name, path / name)
    return path
