"""Checkpoint loading: typed errors for bad directories, sharded weights, tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.models import SUPPORTED_ARCHITECTURES, load_model, write_random_checkpoint
from engine.models.arch import arch_from_config
from engine.models.tiny_random import tiny_random_config

# The first embedding values of tiny-random (seeded CPU draw); the same on every machine.
EMBED_HEAD = [-0.04729798808693886, -0.02489664778113365, 0.12666967511177063]


def _small(path: Path, **kwargs) -> Path:
    return write_random_checkpoint(path, num_layers=1, hidden_size=64, num_heads=2, **kwargs)


def test_tiny_random_is_identical_on_every_load() -> None:
    first = load_model("tiny-random", device="cpu")
    second = load_model("tiny-random", device="cpu")
    arch = first.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (4, 256, 8, 2)
    for (name, a), (_, b) in zip(
        first.model.named_parameters(), second.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    # Pinned values: a change in the draw (order, seed, generator) changes every output.
    weight = first.model.embed_tokens.weight
    assert weight.dtype == torch.float32
    assert weight[0, :3].tolist() == pytest.approx(EMBED_HEAD, abs=1e-6)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    single = _small(tmp_path / "single", seed=9)
    sharded = _small(tmp_path / "sharded", seed=9, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(str(single), device="cpu").model.state_dict()
    b = load_model(str(sharded), device="cpu").model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path), device="cpu")


def test_malformed_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="missing or has a bad field"):
        load_model(str(tmp_path), device="cpu")


def test_missing_and_misshaped_weights(tmp_path: Path) -> None:
    path = _small(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \.safetensors"):
        load_model(str(path), device="cpu")
    other = _small(tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] = 100
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(str(other), device="cpu")


def test_truncated_weights_file(tmp_path: Path) -> None:
    path = _small(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError):
        load_model(str(path), device="cpu")


def test_unsupported_architecture_and_rope_type() -> None:
    config = tiny_random_config()
    with pytest.raises(UnsupportedModelError) as info:
        arch_from_config({**config, "architectures": ["MambaForCausalLM"]})
    assert info.value.supported == SUPPORTED_ARCHITECTURES
    with pytest.raises(UnsupportedModelError, match="yarn"):
        arch_from_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen_variants_are_described() -> None:
    config = tiny_random_config()
    qwen2 = arch_from_config({**config, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = arch_from_config({**config, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen2.qkv_bias
    assert not qwen2.qk_norm
    assert qwen3.qk_norm
    assert not qwen3.qkv_bias
