"""RMSNorm, plain and fused with the residual add that precedes it in every decoder layer.

Both compute in float32 and cast the result back to the input's dtype, so bfloat16 models
lose no precision in the reduction.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``.

    The new residual is rounded to the input dtype once, and the norm is taken of that
    rounded sum, so the value the next layer adds back is exactly the one that was normed.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # A Triton variant slots in here, behind kernels.backend.use_triton(x).
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # A Triton variant slots in here, behind kernels.backend.use_triton(x).
    return fused_add_rms_norm_ref(x, residual, weight, eps)
