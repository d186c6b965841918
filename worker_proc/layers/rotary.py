"""Rotary position embedding with a precomputed float32 cos/sin cache.

The frequencies follow the config's ``rope_scaling`` (worker_proc/layers/rope_scaling.py);
YaRN's attention factor is folded into the cache, so the kernels that read it need not know
the type. The cache covers ``max_position`` positions and lives on the model's device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import kernels
from worker_proc.layers.rope_scaling import rope_frequencies


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
        inv_freq, attention_factor = rope_frequencies(base, self.rotary_dim, rope_scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0)  # [max_position, rotary_dim/2]
        # Always float32, whatever the model dtype: angles at large positions need it.
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

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
