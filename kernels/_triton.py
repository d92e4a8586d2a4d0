"""Optional Triton: the package imports (and the references run) without it.

Triton is imported only where a kernel can run: on a machine with a CUDA device, or with
Triton's interpreter switched on (TRITON_INTERPRET=1, how the kernels are tested without
a GPU). Elsewhere the engine runs the references and Triton would only cost start-up
time and, at every exit, a page of nanobind "leaked instances" warnings on stderr.

`jit` is `triton.jit` when Triton is imported and the identity otherwise, so each op
module can define its `_<op>_kernel` at import time either way (the op modules' postponed
annotations keep `tl.constexpr` unevaluated). `launchable` hands a launcher the kernel to
call for a device: the compiled kernel for GPU tensors, and the same kernel under
Triton's interpreter for CPU tensors, which is how the kernels are tested on machines
without a GPU whatever TRITON_INTERPRET said when they were defined.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

triton: Any = None
tl: Any = None
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:  # the references still work; the launchers refuse to run
        pass

__all__ = ["jit", "launchable", "next_power_of_2", "require_triton", "tl", "triton"]

_interpreted: dict[int, Any] = {}


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit(fn)` when Triton is installed, else `fn` unchanged."""
    return fn if triton is None else triton.jit(fn)


def require_triton(op: str) -> None:
    """Raise RuntimeError naming `op` when Triton is not imported."""
    if triton is None:
        raise RuntimeError(
            f"{op} needs triton and a CUDA device (or TRITON_INTERPRET=1 before the first"
            f" import of kernels); or call {op}_ref"
        )


def launchable(kernel: Any, device: torch.device) -> Any:
    """The object to index with a grid and call: `kernel` on CUDA, interpreted on CPU."""
    if device.type == "cuda":
        return kernel
    if device.type != "cpu":
        raise ValueError(f"Triton kernels run on cuda (or cpu, interpreted), not {device.type}")
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    key = id(kernel)
    if key not in _interpreted:
        _interpreted[key] = _InterpretedLaunch(InterpretedFunction(kernel.fn))
    return _interpreted[key]


class _InterpretedLaunch:
    """Run a kernel under the interpreter although triton was imported in compiled mode.

    Then triton.language's own helpers (tl.sum, tl.max, tl.cdiv) and our nested @jit
    functions are compiled-mode JITFunctions, which refuse to be called from Python; for
    the length of one interpreted launch they run their Python body instead, which is
    what the interpreter would have made of them. A lock keeps launches one at a time.
    """

    _lock = threading.Lock()

    def __init__(self, interpreted: Any) -> None:
        self._interpreted = interpreted

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            from triton.runtime.jit import JITFunction

            with self._lock:
                saved = JITFunction.__call__
                JITFunction.__call__ = _call_python_body
                try:
                    return self._interpreted[grid](*args, **kwargs)
                finally:
                    JITFunction.__call__ = saved

        return launch


def _call_python_body(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self.fn(*args, **kwargs)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()
