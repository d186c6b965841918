"""Rotary position embedding with a precomputed float32 cos/sin cache.

Supported ``rope_scaling`` types: None/"default", "linear" (positions divided by a factor)
and "llama3" (low frequencies divided by a factor, a smooth ramp between). The cache covers
``max_position`` positions and lives on the model's device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import kernels


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original_max = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by the full factor, short ones kept, and
    # the band between interpolates smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def compute_inv_freq(base: float, rotary_dim: int, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, rotary_dim)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq = compute_inv_freq(base, self.rotary_dim, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0)  # [max_position, rotary_dim/2]
        # Always float32, whatever the model dtype: angles at large positions need it.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, num_heads * head_dim]`` and ``k [T, num_kv_heads * head_dim]``
        (or already split into heads); returns them in their input shapes."""
        num_tokens = positions.shape[0]
        q_rot, k_rot = kernels.rotary_embedding(
            positions,
            q.view(num_tokens, -1, self.head_dim),
            k.view(num_tokens, -1, self.head_dim),
            self.cos_cache,
            self.sin_cache,
        )
        return q_rot.view(q.shape), k_rot.view(k.shape)
