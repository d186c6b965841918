"""Rotary position embedding, NeoX style (the two halves of each head are the pairs).

The cos/sin caches are float32 ``[max_positions, rotary_dim // 2]``, built once by the
rotary layer; the rotation is computed in float32 and cast back.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2]
    rotary_dim = cos.shape[-1] * 2
    x32 = x.float()
    x_rot, x_pass = x32[..., :rotary_dim], x32[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if x_pass.shape[-1]:
        rotated = torch.cat((rotated, x_pass), dim=-1)
    return rotated.to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, num_heads, head_dim]`` and ``k [T, num_kv_heads, head_dim]`` by the
    angles of ``positions [T]``. Returns new tensors; callers use the return values, which
    leaves a Triton variant free to work in place."""
    cos = cos_cache.index_select(0, positions).unsqueeze(1)
    sin = sin_cache.index_select(0, positions).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # A Triton variant slots in here, behind kernels.backend.use_triton(q).
    return rotary_embedding_ref(positions, q, k, cos_cache, sin_cache)
