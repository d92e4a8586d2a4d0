"""resolve: Triton launchers on CUDA when Triton works, references otherwise."""

from __future__ import annotations

import importlib
import os
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the engine uses Triton")
def test_a_cpu_engine_leaves_triton_unimported():
    # Imported where no kernel can run, Triton printed a page of nanobind "leaked
    # instances" warnings at every exit of `tiergate serve`.
    code = (
        "import sys\n"
        "from engine.llm import LLM\n"
        "from engine.sampling import SamplingParams\n"
        "llm = LLM('tiny-random', device='cpu', max_model_len=64)\n"
        "[out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "assert out.num_output_tokens == 3, out\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "nanobind" not in result.stderr
