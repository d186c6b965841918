"""Gated activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dimension."""
    half = x.shape[-1] // 2
    x32 = x.float()
    return (F.silu(x32[..., :half]) * x32[..., half:]).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # A Triton variant slots in here, behind kernels.backend.use_triton(x).
    return silu_and_mul_ref(x)
