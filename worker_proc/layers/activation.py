"""Activation modules over the kernels."""

from __future__ import annotations

import torch
from torch import nn

import kernels


class SiluAndMul(nn.Module):
    """``[..., 2 * d] -> [..., d]``: silu of the first half times the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)
