"""rms_norm and its reference against Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.rms_norm import rms_norm, rms_norm_ref


def _hf_rms_norm(x, weight, eps):
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 128), (33, 1000)])
def test_ref_matches_hf_exactly(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    out, residual_out = rms_norm_ref(x, weight, 1e-6)
    assert torch.equal(out, _hf_rms_norm(x, weight, 1e-6))
    assert residual_out is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_fused_residual(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((13, 80), generator=gen).to(dtype)
    residual = torch.randn((13, 80), generator=gen).to(dtype)
    weight = torch.randn(80, generator=gen).to(dtype)
    out, residual_out = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(residual_out, x + residual)
    assert torch.equal(out, _hf_rms_norm(x + residual, weight, 1e-5))


def test_ref_empty_batch():
    out, residual_out = rms_norm_ref(torch.empty((0, 64)), torch.ones(64), 1e-6)
    assert out.shape == residual_out.shape == (0, 64)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"weight": torch.ones(63)}, ValueError),
        ({"weight": torch.ones(2, 64)}, ValueError),
        ({"x": torch.ones(4, 64, dtype=torch.int64)}, TypeError),
        ({"x": torch.tensor(1.0)}, ValueError),
        ({"residual": torch.ones(4, 63)}, ValueError),
        ({"residual": torch.ones(4, 64, dtype=torch.float16)}, TypeError),
        ({"residual": [1.0]}, TypeError),
    ],
)
def test_ref_rejects_bad_input(kwargs, error):
    args = {"x": torch.ones(4, 64), "weight": torch.ones(64), "eps": 1e-6, "residual": None}
    args.update(kwargs)
    with pytest.raises(error):
        rms_norm_ref(**args)


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 128), (33, 1000)])
def test_triton_matches_ref(target, shape, has_residual):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(shape, generator=gen).to(target.dtype).to(target.device)
    weight = torch.randn(shape[-1], generator=gen).to(target.dtype).to(target.device)
    residual = None
    if has_residual:
        residual = torch.randn(shape, generator=gen).to(target.dtype).to(target.device)
    out, residual_out = rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)
    # The residual sum is one rounding in both: equal up to one ulp of the dtype.
    torch.testing.assert_close(residual_out, expected_residual, atol=target.atol, rtol=target.rtol)


def test_triton_reads_strided_rows(target):
    x = torch.randn((6, 256)).to(target.dtype).to(target.device)[:, :128]  # row stride 256
    weight = torch.ones(128, dtype=target.dtype, device=target.device)
    out, _ = rms_norm(x, weight, 1e-5)
    expected, _ = rms_norm_ref(x, weight, 1e-5)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"weight": torch.ones(63)}, ValueError),
        ({"x": torch.ones(4, 64, dtype=torch.int64)}, TypeError),
        ({"residual": torch.ones(4, 64, dtype=torch.float16)}, TypeError),
    ],
)
def test_triton_rejects_bad_input(kwargs, error):
    pytest.importorskip("triton")
    args = {"x": torch.ones(4, 64), "weight": torch.ones(64), "eps": 1e-6, "residual": None}
    args.update(kwargs)
    with pytest.raises(error):
        rms_norm(**args)
