"""RMSNorm with an optional fused residual add, as in Llama-family decoder layers.

When `residual` is given the layer input is `x + residual`; that sum is also returned so
the next layer can add to it (the residual stream never leaves the model dtype, as in the
Hugging Face models). Normalisation runs in float32 and is cast back to x.dtype.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor
from kernels._triton import jit, launchable, next_power_of_2, require_triton, tl


@jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the whole hidden vector fits in one block.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype, as the residual stream is in HF models.
        x = (x + residual.to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(residual_out_ptr + row * hidden_size + cols, x.to(dtype), mask=mask)
    mean_square = tl.sum(x * x, axis=0) / hidden_size
    # Normalise in fp32, round to the model dtype, then scale (LlamaRMSNorm's order).
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, (normed * weight).to(dtype), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the hidden size)")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a floating tensor (fp16, bf16, fp32), got {x.dtype}")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight has {weight.shape[0]} elements but x's hidden size is {x.shape[-1]}"
        )
    if residual is None:
        check_same_device(x=x, weight=weight)
        return
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    check_same_device(x=x, weight=weight, residual=residual)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rms_norm`, same contract as `rms_norm_ref`: returns (out, residual_out).

    Both outputs are new contiguous tensors shaped like x; residual_out is x when no
    residual is given.
    """
    require_triton("rms_norm")
    _check(x, weight, residual)
    hidden_size = x.shape[-1]
    # Rows must be addressable by one stride with unit-stride columns.
    rows = x.reshape(-1, hidden_size)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_rows, residual_out = rows, x
    else:
        residual_rows = residual.reshape(-1, hidden_size)
        if residual_rows.shape[0] and residual_rows.stride(-1) != 1:
            residual_rows = residual_rows.contiguous()
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out, residual_out
    kernel = launchable(_rms_norm_kernel, x.device)
    kernel[(rows.shape[0],)](
        rows,
        residual_rows,
        weight,
        out,
        residual_out,
        rows.stride(0),
        residual_rows.stride(0),
        hidden_size,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_power_of_2(hidden_size),
    )
    return out, residual_out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rms_norm`: returns (normalised, residual_out).

    x: `[..., hidden]`; weight: `[hidden]`. If residual is given, x = x + residual first;
    residual_out is that sum (or x itself). out = x * rsqrt(mean(x^2) + eps) * weight in
    the order Hugging Face's LlamaRMSNorm uses (normalise in fp32, cast, scale).
    """
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)).to(x.dtype)
    return out, x
