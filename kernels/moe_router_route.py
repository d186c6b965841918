"""A sparse layer's router ending in its routing and grouping: one kernel from the layer's
input to the grouped GEMMs' layout, for decode batches of up to
``moe_route_group.PAIRS_IN_REGISTERS`` pairs.

At such batches the router's projection (a few hundred KB of weight) and the routing after
it are two short kernels, each a launch, a wait and a ramp in a chain of nine a layer. Here
each program computes one expert's logit for every token: it reads its weight row before
the PDL wait (weights are written before the step), then the tokens' input, and applies the
input's pending norm (kernels/pending_norm.py) as the router's GEMV does. It stores the
logit rounded to the input's dtype, as the GEMV's output is, and counts in; the last program
to arrive routes every token and lays the pairs out in registers
(``moe_route_group.group_pairs``), the register kernel's work on the same logits.

It runs above ``FUSED_MIN_PAIRS`` pairs. ``PEGAINFER_MOE_FUSED_ROUTER=0`` runs the router's
GEMV and the register kernel instead at every batch, ``=1`` this kernel from one pair.
"""

from __future__ import annotations

import os

import torch

from kernels import attention_merge, gemv, moe_route_group, moe_routing, pdl, pending_norm
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl, weight_eviction
from kernels.moe_grouping import MoeGroups, group_buffers
from kernels.pending_norm import PendingNorm

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Input elements a thread holds a K tile: the tile is as wide as that allows.
_ELEMENTS_PER_THREAD = 64
# Pairs up to which the router's GEMV and the register kernel run apart instead. On an H100
# (Qwen3-30B-A3B's shape, 16 layers, in-process decode steps alternated twice) fusing took 4
# and 8 rows from 2.50 / 3.66 to 2.46 / 3.65 ms a step, 2 rows stayed at 1.70-1.71, and 1 row
# went from 1.19 to 1.21: there the arrival's atomic and the last program's routing cost
# more than the launch they save (tools/MEASUREMENTS.md).
FUSED_MIN_PAIRS = 16
# K tiles read before the PDL wait (at Qwen3-30B-A3B's hidden size of 2,048, the whole row
# from one to eight tokens).
_PREFETCH_TILES = 2


@triton_jit(do_not_specialize=("num_tokens", "max_padded"))
def _router_route_kernel(
    x_ptr,
    router_w_ptr,
    in_sums_ptr,
    logits_ptr,
    counter_ptr,
    weights_ptr,
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_tokens,
    max_padded,
    hidden,
    stride_x_row,
    stride_w_row,
    num_in_groups,
    eps,
    NORMED: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    TILE_K: tl.constexpr,
    PREFETCH_TILES: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_BLOCKS: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    W_EVICT: tl.constexpr,
):
    expert = tl.program_id(0)
    w_row = router_w_ptr + expert.to(tl.int64) * stride_w_row
    if PREFETCH_TILES >= 1:
        w_0 = gemv.weight_tile(w_row, 0, hidden, TILE_K, W_EVICT)
    if PREFETCH_TILES >= 2:
        w_1 = gemv.weight_tile(w_row, 1, hidden, TILE_K, W_EVICT)
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    x_rows = x_ptr + tl.where(token_ok, tokens, 0).to(tl.int64)[:, None] * stride_x_row
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if NORMED:
        square_sums = pending_norm.load_square_sums(
            in_sums_ptr, tokens, token_ok, num_in_groups, num_in_groups, IN_GROUPS
        )
    logits = tl.zeros([BLOCK_T], dtype=tl.float32)
    if PREFETCH_TILES >= 1:
        x_0 = gemv.weight_tile(x_rows, 0, hidden, TILE_K, "").to(tl.float32)
        logits += tl.sum(x_0 * w_0.to(tl.float32), axis=1)
    if PREFETCH_TILES >= 2:
        x_1 = gemv.weight_tile(x_rows, 1, hidden, TILE_K, "").to(tl.float32)
        logits += tl.sum(x_1 * w_1.to(tl.float32), axis=1)
    for tile in range(PREFETCH_TILES, tl.cdiv(hidden, TILE_K)):
        w = gemv.weight_tile(w_row, tile, hidden, TILE_K, W_EVICT).to(tl.float32)
        x = gemv.weight_tile(x_rows, tile, hidden, TILE_K, "").to(tl.float32)
        logits += tl.sum(x * w, axis=1)
    if NORMED:
        logits *= pending_norm.inverse_rms(square_sums, hidden, eps)
    tl.store(
        logits_ptr + tokens * NUM_EXPERTS + expert,
        logits.to(logits_ptr.dtype.element_ty),
        mask=token_ok,
    )
    if attention_merge.arrive_last(counter_ptr, NUM_EXPERTS):
        moe_routing.route_tokens(
            logits_ptr,
            weights_ptr,
            experts_ptr,
            0,
            num_tokens,
            NUM_EXPERTS,
            NUM_EXPERTS,
            TOP_K,
            BLOCK_E,
            BLOCK_K,
            RENORMALIZE,
            BLOCK_T,
            ".cg",
        )
        tl.debug_barrier()
        moe_route_group.group_pairs(
            experts_ptr,
            sorted_pairs_ptr,
            block_expert_ptr,
            num_padded_ptr,
            num_tokens * TOP_K,
            max_padded,
            BLOCK_E,
            BLOCK_P,
            BLOCK_M,
            BLOCK_BLOCKS,
            TAIL_CHUNK,
        )
        tl.store(counter_ptr, 0)  # ready for the next launch (or graph replay)


def router_fused(num_tokens: int, top_k: int) -> bool:
    """Whether ``router_route_and_group_triton`` takes these tokens: above
    ``FUSED_MIN_PAIRS`` pairs, up to the register kernel's. ``PEGAINFER_MOE_FUSED_ROUTER=0``:
    never; ``=1``: from one pair."""
    setting = os.environ.get("PEGAINFER_MOE_FUSED_ROUTER")
    if setting == "0" or not moe_route_group.pairs_in_registers(num_tokens, top_k):
        return False
    return setting == "1" or num_tokens * top_k > FUSED_MIN_PAIRS


def router_tile_k(num_tokens: int, hidden: int, num_warps: int) -> int:
    """The K tile: ``_ELEMENTS_PER_THREAD`` input elements a thread for the batch's rows."""
    rows = next_power_of_2(num_tokens)
    return min(next_power_of_2(hidden), max(64, _ELEMENTS_PER_THREAD * 32 * num_warps // rows))


def router_route_and_group_ref(
    x: torch.Tensor | PendingNorm,
    router_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    """The router's projection (the norm applied first where pending), then
    ``moe_route_and_group_ref``."""
    logits = torch.nn.functional.linear(pending_norm.as_tensor(x), router_weight)
    return moe_route_group.moe_route_and_group_ref(logits, top_k, renormalize, block_m)


def router_route_and_group_triton(
    x: torch.Tensor | PendingNorm,
    router_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    """``x [T, H] @ router_weight.T``, routed and grouped in one kernel (see above)."""
    normed = x if isinstance(x, PendingNorm) else None
    inputs = normed.weighted if normed is not None else x
    num_tokens, hidden = inputs.shape
    num_experts = router_weight.shape[0]
    if not moe_route_group.PAIRS_IN_REGISTERS >= num_tokens * top_k > 0:
        raise ValueError(f"{num_tokens} tokens of top {top_k} are too many pairs for one program")
    if router_weight.shape[1] != hidden:
        raise ValueError(f"router weight {tuple(router_weight.shape)} for inputs of {hidden}")
    if inputs.stride(-1) != 1:
        inputs = inputs.contiguous()
    device = inputs.device
    logits = torch.empty((num_tokens, num_experts), dtype=inputs.dtype, device=device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    experts = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    sorted_pairs, block_expert, num_padded, _ = group_buffers(
        num_tokens * top_k, num_experts, block_m, device
    )
    load_triton()
    num_warps = moe_route_group.register_pairs_warps(num_tokens, top_k)
    tile_k = router_tile_k(num_tokens, hidden, num_warps)
    with_pdl = use_pdl(inputs)
    _router_route_kernel[(num_experts,)](
        inputs,
        router_weight,
        normed.square_sums if normed is not None else inputs,
        logits,
        split_counters(1, device),
        weights,
        experts,
        sorted_pairs,
        block_expert,
        num_padded,
        num_tokens,
        sorted_pairs.numel(),
        hidden,
        inputs.stride(0),
        router_weight.stride(0),
        normed.num_groups if normed is not None else 1,
        normed.eps if normed is not None else 0.0,
        NORMED=normed is not None,
        IN_GROUPS=normed.groups_block if normed is not None else 1,
        TILE_K=tile_k,
        PREFETCH_TILES=min(_PREFETCH_TILES, cdiv(hidden, tile_k)),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_E=next_power_of_2(num_experts),
        BLOCK_K=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=next_power_of_2(num_tokens),
        BLOCK_P=next_power_of_2(num_tokens * top_k),
        BLOCK_M=block_m,
        BLOCK_BLOCKS=next_power_of_2(block_expert.numel()),
        TAIL_CHUNK=moe_route_group.TAIL_CHUNK,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_router"),
        W_EVICT=weight_eviction(),
        num_warps=num_warps,
        **pdl.launch_options(with_pdl),
    )
    return weights, experts, MoeGroups(sorted_pairs, block_expert, num_padded, block_m)
