"""resolve: Triton launchers on CUDA when Triton works, references otherwise."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.registry import OPS, is_triton_available, resolve


@pytest.mark.parametrize("op", OPS)
def test_cpu_gets_the_reference(op):
    assert resolve(op, "cpu").__name__ == f"{op}_ref"


@pytest.mark.parametrize("op", OPS)
def test_cuda_gets_triton_only_when_usable(op):
    fn = resolve(op, "cuda")
    expected = op if is_triton_available() else f"{op}_ref"
    assert fn.__name__ == expected


def test_unknown_op_is_a_value_error():
    with pytest.raises(ValueError, match="unknown kernel op"):
        resolve("flash_mla", "cuda")


def test_every_op_has_both_implementations():
    for op in OPS:
        module = importlib.import_module(resolve(op, "cpu").__module__)
        assert callable(getattr(module, op))
        assert callable(getattr(module, f"{op}_ref"))


def test_triton_availability_follows_the_device():
    assert is_triton_available() == (
        torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    )


def test_without_triton_kernels_import_and_resolve_to_references():
    # A None entry in sys.modules makes `import triton` raise ImportError.
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels.registry import OPS, resolve\n"
        "from kernels.rms_norm import rms_norm\n"
        "assert all(resolve(op, 'cuda').__name__ == op + '_ref' for op in OPS)\n"
        "try:\n"
        "    rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "except RuntimeError as error:\n"
        "    assert 'needs triton' in str(error)\n"
        "else:\n"
        "    raise SystemExit('the launcher ran without triton')\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
