"""Pick the implementation of an op for a device: the engine calls only `resolve`.

On CUDA with Triton importable the Triton launcher runs; everywhere else (CPU, a GPU
without Triton) the plain-torch reference of the same signature does.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

# op name -> module holding `<op>` (Triton launcher) and `<op>_ref`.
_MODULES = {
    "write_kv": "kernels.write_kv",
    "decode_attention": "kernels.decode_attention",
    "prefill_attention": "kernels.prefill_attention",
    "rms_norm": "kernels.rms_norm",
    "rotary_embedding": "kernels.rotary",
}
OPS = tuple(_MODULES)


@functools.cache
def is_triton_available() -> bool:
    """True when triton imports and torch sees a CUDA device."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    import torch

    return torch.cuda.is_available()


def resolve(op: str, device_type: str) -> Callable[..., Any]:
    """Return the implementation of `op` for `device_type` ("cuda", "cpu", ...).

    Raises ValueError for an op name that is not one of `OPS`.
    """
    if op not in _MODULES:
        raise ValueError(f"unknown kernel op {op!r}; known: {', '.join(OPS)}")
    module = importlib.import_module(_MODULES[op])
    if device_type == "cuda" and is_triton_available() and hasattr(module, op):
        return getattr(module, op)
    return getattr(module, f"{op}_ref")
