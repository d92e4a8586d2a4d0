"""RMSNorm with an optional fused residual add, as in Llama-family decoder layers.

When `residual` is given the layer input is `x + residual`; that sum is also returned so
the next layer can add to it (the residual stream never leaves the model dtype, as in the
Hugging Face models). Normalisation runs in float32 and is cast back to x.dtype.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor


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
