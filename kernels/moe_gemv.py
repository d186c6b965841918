"""The experts of a few decode tokens as GEMVs on CUDA cores, with no grouping by expert.

At one token the grouped GEMMs (kernels/fused_moe.py) pad each expert's row to a 16-row
block and run a program per 64 features of an expert: 96 programs for Qwen3-30B-A3B's
gate/up, fewer than an H100 has SMs, at 70% of the bytes' floor. Here thousands of programs
take a few features each, as in the dense GEMV (kernels/gemv.py). Pairs of different tokens
that share an expert read it once each (from L2 when they run side by side), so this pays
only for a few tokens.

- ``_gate_up_kernel``, a program per (pair, feature tile): ``silu(x @ gate.T) * (x @ up.T)``
  of its token's row, both projections rounded to the dtype first; a pending input norm
  (kernels/pending_norm.py) scales them by the row's ``1 / rms``. With ``ROUTE`` each program
  first routes its token from the router's logits (kernels/moe_routing.py), so no routing
  kernel runs between the router and this one.
- ``_down_kernel``, a program per (token, feature tile): the routing-weighted sum of the
  token's experts' down projections in float32, ending in a float32 store or, as the dense
  down GEMV, in the residual add with the next norm left pending (no sum kernel after).

The reference is ``moe_gemv_ref``: ``fused_moe_ref``'s roundings, the sum left in float32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels import moe_routing, pdl, pending_norm
from kernels.attention_merge import split_counters
from kernels.backend import (
    cdiv,
    load_triton,
    next_power_of_2,
    triton_jit,
    use_pdl,
    weight_eviction,
)
from kernels.fused_moe import fused_moe_sum_ref
from kernels.gemv import group_tiles_now
from kernels.pending_norm import PendingNorm

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Up to this many tokens the sparse MLP runs these GEMVs (PEGAINFER_MOE_GEMV_TOKENS; 0:
# never): each pair then reads its expert alone, which at 4 tokens of top-8 of 128 experts
# reads 10% more than the experts touched.
GEMV_MAX_TOKENS = 4


def gemv_max_tokens() -> int:
    return int(os.environ.get("PEGAINFER_MOE_GEMV_TOKENS", GEMV_MAX_TOKENS))


@dataclass(frozen=True)
class GemvTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Features and K chunk a program takes, as the dense one-row GEMV's at K = 2,048 and 768.
GATE_UP_TILE = GemvTile(block_n=2, block_k=512, num_warps=2, num_stages=1)
DOWN_TILE = GemvTile(block_n=2, block_k=256, num_warps=2, num_stages=1)


def tiles_now() -> tuple[GemvTile, GemvTile]:
    """The gate/up and down tiles; ``PEGAINFER_MOE_GEMV_TILES=n,k,warps,stages/n,k,warps,
    stages`` overrides them (for tuning)."""
    setting = os.environ.get("PEGAINFER_MOE_GEMV_TILES")
    if not setting:
        return GATE_UP_TILE, DOWN_TILE
    gate_up, down = (GemvTile(*map(int, part.split(","))) for part in setting.split("/"))
    return gate_up, down


def moe_gemv_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_experts: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum, ``[T, H]`` float32, with the GEMVs' roundings."""
    return fused_moe_sum_ref(x, w13, w2, topk_weights, topk_experts)


@triton_jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    experts_ptr,
    weights_ptr,
    logits_ptr,
    in_sums_ptr,
    K,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_logits,
    num_in_groups,
    eps,
    TOP_K: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    ROUTE: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    # Pairs vary fastest, so the pairs of an expert's feature tile run side by side.
    pair = tl.program_id(0)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < inter
    safe_features = tl.where(feature_ok, features, 0).to(tl.int64)
    token = tl.zeros([1], dtype=tl.int64) + pair // TOP_K
    # The experts come from the kernel just before (the router, or the routing): nothing to
    # read early.
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if ROUTE:
        # Every program of a token routes it from the router's logits (k rounds of arg-max
        # over a row of a few hundred bytes), which costs less than a routing kernel between
        # the router and this one; the programs of the first feature tile store the routing
        # for the down kernel.
        chosen_weights, chosen_experts = moe_routing.top_experts(
            logits_ptr,
            token,
            token >= 0,
            stride_logits,
            NUM_EXPERTS,
            TOP_K,
            BLOCK_E,
            BLOCK_TOP_K,
            RENORMALIZE,
            1,
        )
        slots = tl.arange(0, BLOCK_TOP_K)[None, :]
        mine = slots == pair % TOP_K
        expert = tl.sum(tl.sum(tl.where(mine, chosen_experts, 0), axis=1), axis=0)
        if tl.program_id(1) == 0:
            pair_weight = tl.sum(tl.sum(tl.where(mine, chosen_weights, 0.0), axis=1), axis=0)
            tl.store(experts_ptr + pair, expert)
            tl.store(weights_ptr + pair, pair_weight)
    else:
        expert = tl.load(experts_ptr + pair)
    expert = tl.minimum(tl.maximum(expert, 0), NUM_EXPERTS - 1).to(tl.int64)
    if IN_GROUPS > 0:
        square_sums = pending_norm.load_square_sums(
            in_sums_ptr, token, token >= 0, num_in_groups, num_in_groups, IN_GROUPS
        )
    gate_rows = w_ptr + expert * stride_we + safe_features[:, None] * stride_wn
    up_rows = gate_rows + inter * stride_wn
    x_row = x_ptr + token[:, None] * stride_x
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_ok = (ks < K)[None, :]
        x = tl.load(x_row + ks[None, :], mask=k_ok, other=0.0).to(tl.float32)
        w_gate = tl.load(gate_rows + ks[None, :], mask=k_ok, other=0.0, eviction_policy=W_EVICT)
        w_up = tl.load(up_rows + ks[None, :], mask=k_ok, other=0.0, eviction_policy=W_EVICT)
        gate += x * w_gate.to(tl.float32)
        up += x * w_up.to(tl.float32)
    gate_out = tl.sum(gate, axis=1)
    up_out = tl.sum(up, axis=1)
    if IN_GROUPS > 0:
        inverse_rms = tl.sum(pending_norm.inverse_rms(square_sums, K, eps), axis=0)
        gate_out *= inverse_rms
        up_out *= inverse_rms
    dtype = out_ptr.dtype.element_ty
    gate_out = gate_out.to(dtype).to(tl.float32)
    up_out = up_out.to(dtype).to(tl.float32)
    activation = gate_out / (1.0 + tl.exp(-gate_out)) * up_out
    tl.store(out_ptr + pair.to(tl.int64) * inter + features, activation.to(dtype), mask=feature_ok)


@triton_jit
def _down_kernel(
    act_ptr,
    w_ptr,
    experts_ptr,
    weights_ptr,
    out_ptr,
    residual_ptr,
    norm_w_ptr,
    weighted_ptr,
    tile_sums_ptr,
    out_sums_ptr,
    counters_ptr,
    H,
    inter,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    ROUTED_JUST_BEFORE: tl.constexpr,
    ADD_NORM: tl.constexpr,
    GROUP_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    token = tl.program_id(0).to(tl.int64)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < H
    safe_features = tl.where(feature_ok, features, 0).to(tl.int64)
    offsets = token * H + features
    if ADD_NORM:
        # Written before the sparse MLP's kernels began: readable before the wait.
        residual = tl.load(residual_ptr + offsets, mask=feature_ok, other=0.0)
        norm_w = tl.load(norm_w_ptr + safe_features).to(tl.float32)
    slots = tl.arange(0, BLOCK_TOP_K)
    slot_ok = slots < TOP_K
    pairs = token * TOP_K + slots
    act_rows = act_ptr + pairs[:, None, None] * inter
    # A routing from before the gate/up kernel is readable before the wait too; one that the
    # gate/up kernel wrote (``ROUTED_JUST_BEFORE``) only after it.
    if not ROUTED_JUST_BEFORE:
        experts = tl.load(experts_ptr + pairs, mask=slot_ok, other=0)
        pair_weights = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if ROUTED_JUST_BEFORE:
        experts = tl.load(experts_ptr + pairs, mask=slot_ok, other=0)
        pair_weights = tl.load(weights_ptr + pairs, mask=slot_ok, other=0.0)
    experts = tl.minimum(tl.maximum(experts, 0), NUM_EXPERTS - 1).to(tl.int64)
    # One [experts, features, K] tile a step: the TOP_K experts' weight tiles are in flight
    # together (at one token there are only a thousand programs, too few to fill the memory
    # system with one expert's tile each).
    w_tiles = w_ptr + experts[:, None, None] * stride_we + safe_features[None, :, None] * stride_wn
    pair_weights = pair_weights[:, None, None]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in tl.range(0, inter, BLOCK_K, num_stages=LOOP_STAGES):
        ks = (k_start + tl.arange(0, BLOCK_K))[None, None, :]
        mask = slot_ok[:, None, None] & (ks < inter)
        w = tl.load(w_tiles + ks, mask=mask, other=0.0, eviction_policy=W_EVICT)
        act = tl.load(act_rows + ks, mask=mask, other=0.0)
        acc += tl.sum(act.to(tl.float32) * pair_weights * w.to(tl.float32), axis=0)
    y = tl.sum(acc, axis=1)
    if ADD_NORM:
        squares = pending_norm.add_loaded_residual_and_square(
            y[None, :],
            residual[None, :],
            out_ptr + offsets[None, :],
            norm_w[None, :],
            weighted_ptr + offsets[None, :],
            feature_ok[None, :],
            1,
        )
        rows = tl.zeros([1], dtype=tl.int64) + token
        pending_norm.sum_group_squares(
            squares, rows, rows >= 0, tile_sums_ptr, out_sums_ptr, counters_ptr, GROUP_TILES
        )
    else:
        tl.store(out_ptr + offsets, y, mask=feature_ok)


def moe_gemv_triton(
    x: torch.Tensor | PendingNorm,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_experts: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | PendingNorm:
    """The experts of ``x [T, H]`` (a pending norm's stream, normed on the way in) summed
    over each token's ``topk_experts`` by ``topk_weights``: ``[T, H]`` float32, or with
    ``residual`` and ``norm_weight`` the new residual with the norm after it pending."""
    experts = topk_experts.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    return _launch(x, w13, w2, experts, weights, None, False, residual, norm_weight, eps)


def moe_gemv_routed_triton(
    x: torch.Tensor | PendingNorm,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | PendingNorm:
    """``moe_gemv_triton`` routed by ``router_logits [T, E]`` inside the gate/up kernel (as
    ``moe_route_ref``): no routing kernel of its own."""
    num_tokens = router_logits.shape[0]
    experts = torch.empty(num_tokens * top_k, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=router_logits.device)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    return _launch(x, w13, w2, experts, weights, logits, renormalize, residual, norm_weight, eps)


def _launch(
    x: torch.Tensor | PendingNorm,
    w13: torch.Tensor,
    w2: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    router_logits: torch.Tensor | None,
    renormalize: bool,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor | PendingNorm:
    normed = x if isinstance(x, PendingNorm) else None
    x = normed.weighted if normed is not None else x
    num_tokens, hidden = x.shape
    top_k = experts.numel() // max(num_tokens, 1)
    num_experts, double_inter, _ = w13.shape
    inter = double_inter // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    gate_up_tile, down_tile = tiles_now()
    load_triton()
    with_pdl = use_pdl(x)
    routed = router_logits is not None
    activation = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tokens * top_k, cdiv(inter, gate_up_tile.block_n))](
        x,
        w13,
        activation,
        experts,
        weights,
        router_logits if routed else x,
        normed.square_sums if normed is not None else x,
        hidden,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        router_logits.stride(0) if routed else 0,
        normed.num_groups if normed is not None else 1,
        normed.eps if normed is not None else 0.0,
        TOP_K=top_k,
        BLOCK_TOP_K=next_power_of_2(top_k),
        NUM_EXPERTS=num_experts,
        BLOCK_E=next_power_of_2(num_experts),
        ROUTE=routed,
        RENORMALIZE=renormalize,
        IN_GROUPS=(
            normed.groups_block_for_row(gate_up_tile.num_warps) if normed is not None else 0
        ),
        BLOCK_N=gate_up_tile.block_n,
        BLOCK_K=gate_up_tile.block_k,
        LOOP_STAGES=gate_up_tile.num_stages,
        W_EVICT=weight_eviction(),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_gemv"),
        num_warps=gate_up_tile.num_warps,
        num_stages=gate_up_tile.num_stages,
        **pdl.launch_options(with_pdl),
    )
    grid = (num_tokens, cdiv(hidden, down_tile.block_n))
    add_norm = residual is not None
    if add_norm:
        assert norm_weight is not None
        residual = residual.contiguous()
        out = torch.empty_like(residual)
        weighted = torch.empty_like(residual)
        group_tiles = group_tiles_now()
        num_groups = cdiv(grid[1], group_tiles)
        out_sums = torch.empty((num_tokens, num_groups), dtype=torch.float32, device=x.device)
        tile_sums = torch.empty((num_tokens, grid[1]), dtype=torch.float32, device=x.device)
        counters = split_counters(num_tokens * num_groups, x.device)
    else:
        out = torch.empty((num_tokens, hidden), dtype=torch.float32, device=x.device)
        weighted = tile_sums = out_sums = counters = out
        group_tiles = 1
    _down_kernel[grid](
        activation,
        w2,
        experts,
        weights,
        out,
        residual if add_norm else out,
        norm_weight if add_norm else out,
        weighted,
        tile_sums,
        out_sums,
        counters,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        TOP_K=top_k,
        BLOCK_TOP_K=next_power_of_2(top_k),
        NUM_EXPERTS=num_experts,
        ROUTED_JUST_BEFORE=routed,
        ADD_NORM=add_norm,
        GROUP_TILES=group_tiles,
        BLOCK_N=down_tile.block_n,
        BLOCK_K=down_tile.block_k,
        LOOP_STAGES=down_tile.num_stages,
        W_EVICT=weight_eviction(),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_gemv"),
        num_warps=down_tile.num_warps,
        num_stages=down_tile.num_stages,
        **pdl.launch_options(with_pdl),
    )
    if add_norm:
        return PendingNorm(out, norm_weight, eps, out_sums, weighted)
    return out
