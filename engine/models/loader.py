"""Build a DecoderLM from a Hugging Face checkpoint directory (or `tiny-random`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelLoadError
from engine.models.arch import ModelArch, arch_from_config, read_config
from engine.models.attention import AttentionOps
from engine.models.decoder import DecoderLM
from engine.models.rope import cos_sin_cache


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderLM
    arch: ModelArch
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU keeps parity with reference implementations exact enough for
        # greedy token equality; bf16 on CUDA is what the kernels are tuned for.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def build_model(arch: ModelArch, device: torch.device, dtype: torch.dtype) -> DecoderLM:
    """An uninitialised model in `dtype` on `device` (weights are copied in after)."""
    max_positions = arch.max_position_embeddings
    with torch.device("meta"):
        model = DecoderLM(arch, AttentionOps.for_device(device.type), max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    # to_empty leaves buffers uninitialised; the rotary table stays fp32 (the kernels
    # expect it whatever the activation dtype).
    model.cos_sin = cos_sin_cache(arch.rope, arch.head_dim, max_positions).to(device)
    return model.eval()


def load_checkpoint(checkpoint_dir: str | Path, device: str = "auto", dtype: str = "auto"):
    """Read config.json and the safetensors weights (sharded or not) into a DecoderLM."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        # A file (a lone weights file, say) is there: "does not exist" misled.
        why = "is not a directory" if path.exists() else "does not exist"
        raise ModelLoadError(f"model directory {str(path)!r} {why}")
    arch = arch_from_config(read_config(path))
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model = build_model(arch, torch_device, torch_dtype)
    _copy_weights(model, arch, _weight_files(path), torch_dtype)
    return LoadedModel(model, arch, torch_device, torch_dtype)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"malformed {index.name}: {exc!r}") from exc
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no .safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{path} is missing weight shards: {', '.join(missing)}")
    return files


def _target(name: str) -> tuple[str, int | None] | None:
    """Map a Hugging Face tensor name to (our parameter, fused slot) or None to skip."""
    if name.startswith("model."):
        name = name[len("model.") :]
    simple = {
        "embed_tokens.weight": "embed_tokens.weight",
        "norm.weight": "norm",
        "lm_head.weight": "lm_head.weight",
    }
    if name in simple:
        return simple[name], None
    if not name.startswith("layers."):
        return None
    _, index, rest = name.split(".", 2)
    prefix = f"layers.{index}."
    fused = {
        "self_attn.q_proj": ("qkv_proj", 0),
        "self_attn.k_proj": ("qkv_proj", 1),
        "self_attn.v_proj": ("qkv_proj", 2),
        "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, slot = fused[module]
        return f"{prefix}{target}.{kind}", slot
    renamed = {
        "self_attn.o_proj.weight": "o_proj.weight",
        "mlp.down_proj.weight": "down_proj.weight",
        "mlp.down_proj.bias": "down_proj.bias",
        "input_layernorm.weight": "input_norm",
        "post_attention_layernorm.weight": "post_attention_norm",
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
    }
    # Anything else (rotary inv_freq buffers of old checkpoints...) is not a weight of ours.
    return (prefix + renamed[rest], None) if rest in renamed else None


def _copy_weights(model: DecoderLM, arch: ModelArch, files: list[Path], dtype: torch.dtype):
    params = dict(model.named_parameters())
    q_size = arch.num_heads * arch.head_dim
    kv_size = arch.num_kv_heads * arch.head_dim
    fused_offsets = {
        "qkv_proj": [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)],
        "gate_up_proj": [(0, arch.intermediate_size), (arch.intermediate_size,) * 2],
    }
    loaded: set[tuple[str, int | None]] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = _target(name)
                    if target is None or target[0] not in params:
                        continue
                    tensor = handle.get_tensor(name)
                    _copy_one(params, target, tensor, fused_offsets, dtype)
                    loaded.add(target)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights from {file.name}: {exc}") from exc
    expected = set()
    for name in params:
        kind = name.rsplit(".", 1)[-1]
        owner = name.rsplit(".", 2)[-2] if "." in name else ""
        if owner in fused_offsets and kind in ("weight", "bias"):
            expected |= {(name, slot) for slot in range(len(fused_offsets[owner]))}
        else:
            expected.add((name, None))
    missing = sorted(n for n, _ in expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks weights: {', '.join(missing[:5])}")


def _copy_one(params, target, tensor, fused_offsets, dtype) -> None:
    name, slot = target
    param = params[name]
    if slot is None:
        destination = param.data
    else:
        owner = name.rsplit(".", 2)[-2]
        start, size = fused_offsets[owner][slot]
        destination = param.data.narrow(0, start, size)
    if tuple(destination.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}"
        )
    with torch.no_grad():
        destination.copy_(tensor.to(dtype))
