"""Input checks shared by the launchers and the references.

They raise TypeError (wrong dtype or not a tensor) or ValueError (wrong shape, device or
layout) with a message naming the argument, never assert: asserts vanish under -O and a
bad launch on a GPU reads or writes out of bounds instead of failing.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Return `value` if it is a tensor of rank `ndim` with one of `dtypes`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    return value


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Return the one device every tensor lives on, or raise ValueError."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")
    return first


def check_same_dtype(**tensors: torch.Tensor) -> torch.dtype:
    """Return the one dtype every tensor has, or raise TypeError."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    first = next(iter(dtypes.values()))
    if any(d != first for d in dtypes.values()):
        listed = ", ".join(f"{n} is {d}" for n, d in dtypes.items())
        raise TypeError(f"tensors must share one dtype, got {listed}")
    return first


def check_dim(name: str, tensor: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Raise ValueError unless `tensor.shape[dim] == expected` (`what` names the size)."""
    if tensor.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got shape {tuple(tensor.shape)}"
        )


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless `tensor` is contiguous."""
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless the last dimension has stride 1 (rows load as vectors)."""
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got {tensor.stride()}")


def check_kv_cache(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    """Check a paged KV cache pair `[num_blocks, block_size, num_kv_heads, head_dim]`.

    Returns (num_blocks, block_size, num_kv_heads, head_dim).
    """
    k_cache = check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    v_cache = check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    check_same_dtype(k_cache=k_cache, v_cache=v_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Return the query heads per KV head, or raise ValueError if they do not divide."""
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads
