"""Attention over the paged KV cache, for one layer.

The module holds this layer's ``k_cache``/``v_cache`` (views into the runner's allocation,
bound by ``bind_kv_caches``) and reads the step's metadata from the forward context. It
stores the step's keys and values first, then attends, so a sequence's new tokens see each
other causally as well as everything cached before them.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

import kernels
from kernels.backend import next_power_of_2
from kernels.prefill_attention import paged_prefill_attention_triton
from kernels.prefill_tiles import long_query_tokens, prefill_tile
from worker_proc.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, layer_idx: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not group over {num_kv_heads} kv heads")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary: nn.Module | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """``q [T, num_heads * head_dim]``, ``k, v [T, num_kv_heads * head_dim]`` ->
        ``[T, num_heads * head_dim]``. With ``rotary`` (a RotaryEmbedding), q and k are rotated
        here, in the same kernel that writes k and v to the cache: one pass over k instead of
        three. ``qk_norm`` (q weight, k weight, eps): a per-head RMSNorm of q and k before
        rope, fused into the same kernel when there is a rotary embedding."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(f"layer {self.layer_idx} has no KV cache bound")
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if rotary is None:
            if qk_norm is not None:
                q_weight, k_weight, eps = qk_norm
                q, k = kernels.rms_norm(q, q_weight, eps), kernels.rms_norm(k, k_weight, eps)
            kernels.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        else:
            q = kernels.rotary_and_store_kv(
                positions,
                q,
                k,
                v,
                rotary.cos_cache,
                rotary.sin_cache,
                self.k_cache,
                self.v_cache,
                ctx.slot_mapping,
                qk_norm,
            )
        decode_only = ctx.max_query_len == 1 and num_tokens == ctx.num_seqs
        if not decode_only and ctx.prefill_work is None and kernels.use_triton(q):
            queries_per_tile = kernels.prefill_queries_per_tile(
                self.k_cache.dtype,
                self.head_dim,
                self.num_heads // self.num_kv_heads,
                ctx.max_query_len,
            )
            ctx.prefill_work = kernels.prefill_work_table(
                ctx.query_start_loc, num_tokens, queries_per_tile
            )
        out = kernels.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            ctx.block_tables,
            ctx.context_lens,
            ctx.query_start_loc,
            self.scale,
            ctx.max_query_len,
            ctx.max_context_len,
            ctx.split_seqs,
            None if decode_only else ctx.prefill_work,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def launch_eager_prefills(self, max_tokens: int) -> None:
        """Launch prefill attention on one query tile of empty queries in each tile
        (kernels/prefill_tiles.py) that eager steps of at most ``max_tokens`` tokens take, the
        long tile from ``long_query_tokens()`` on and the short one below it, each unsplit
        and split over keys (a step with few KV heads splits). No captured graph launches
        the long tile, so inside a compile-ahead pass this compiles it, and at the real
        capture it loads it, where the first long prompt would wait for both. The launches
        write only their own outputs."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(f"layer {self.layer_idx} has no KV cache bound")
        if not kernels.use_triton(self.k_cache):
            return
        device = self.k_cache.device
        group = self.num_heads // self.num_kv_heads
        lengths = {max_tokens}
        if long_query_tokens() > 1:
            lengths.add(min(max_tokens, long_query_tokens() - 1))
        tiles = {prefill_tile(self.k_cache.dtype, self.head_dim, group, n) for n in lengths}
        for tile, num_splits in itertools.product(sorted(tiles, key=lambda t: t.block_m), (1, 2)):
            queries = max(tile.block_m // next_power_of_2(group), 1)
            q = torch.empty(
                (queries, self.num_heads, self.head_dim), dtype=self.k_cache.dtype, device=device
            )
            blocks = -(-queries // self.k_cache.shape[1])
            paged_prefill_attention_triton(
                q,
                self.k_cache,
                self.v_cache,
                torch.zeros((1, blocks), dtype=torch.int32, device=device),
                torch.full((1,), queries, dtype=torch.int32, device=device),
                torch.tensor([0, queries], dtype=torch.int32, device=device),
                self.scale,
                queries,
                queries,
                block_m=tile.block_m,
                block_n=tile.block_n,
                num_warps=tile.num_warps,
                num_stages=tile.num_stages,
                open_tiles=tile.open_tiles,
                rescale_slack=tile.rescale_slack,
                num_splits=num_splits,
            )


def bind_kv_caches(
    model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[Attention]:
    """Give each Attention layer (in ``layer_idx`` order) its ``(k_cache, v_cache)``."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV caches")
    for layer, (k_cache, v_cache) in zip(layers, kv_caches):
        layer.k_cache, layer.v_cache = k_cache, v_cache
    return layers
