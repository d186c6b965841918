"""Mixture-of-experts routing: each token's top-k experts and their weights.

Routing is a softmax over the router's logits, the ``top_k`` largest probabilities, and
(``renormalize``) those divided by their sum. It runs on the device without a host
synchronisation and with shapes fixed by the token count alone, so a decode step keeps it
inside its CUDA graph.

Up to ``FUSED_ROUTING_MAX_TOKENS`` tokens (decode batches) one single-program kernel routes
the tokens and groups their pairs by expert (kernels/moe_grouping.py), so that a step of a
sparse layer launches one kernel for both; above, the routing kernel (a program to 16
tokens) and the grouping's own kernels run. Both route through ``route_tokens``.
"""

from __future__ import annotations

import torch

from kernels import moe_grouping, pdl
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl, use_triton
from kernels.moe_grouping import (
    PAIR_CHUNK,
    MoeGroups,
    block_chunk,
    group_buffers,
    moe_group_ref,
    moe_group_triton,
)

tl = None  # bound to triton.language by kernels.backend.load_triton()


FUSED_ROUTING_MAX_TOKENS = 64


# --- routing -------------------------------------------------------------------------


def moe_route_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``[T, top_k]`` float32 weights, ``[T, top_k]`` int32 experts),
    the likeliest expert first."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts.to(torch.int32)


@triton_jit
def route_tokens(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    t0,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKEN_CHUNK: tl.constexpr,
):
    """Route tokens ``t0 .. t0 + TOKEN_CHUNK``: the experts fit one tile a token, and top-k
    is k rounds of arg-max."""
    expert_ids = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    tokens = t0 + tl.arange(0, TOKEN_CHUNK)
    token_ok = tokens < num_tokens
    logits = tl.load(
        logits_ptr + tokens.to(tl.int64)[:, None] * stride_logits + expert_ids[None, :],
        mask=token_ok[:, None] & (expert_ids[None, :] < NUM_EXPERTS),
        other=float("-inf"),
    ).to(tl.float32)
    # Rows past the last token route something harmless, never stored.
    logits = tl.where(token_ok[:, None], logits, 0.0)
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    # A row of NaN (a padding row of a graph, say) would match no expert: it gets the first
    # ones at weight 0 instead, so every expert id stays in range.
    probs = tl.where(probs == probs, probs, 0.0)
    remaining = tl.where(expert_ids[None, :] < NUM_EXPERTS, probs, -1.0)
    chosen_weights = tl.zeros([TOKEN_CHUNK, BLOCK_K], dtype=tl.float32)
    chosen_experts = tl.zeros([TOKEN_CHUNK, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        # The lowest index among equal probabilities, as a stable top-k picks.
        is_best = remaining == best[:, None]
        index = tl.min(tl.where(is_best, expert_ids[None, :], BLOCK_E), axis=1)
        chosen_weights = tl.where(slots[None, :] == j, best[:, None], chosen_weights)
        chosen_experts = tl.where(slots[None, :] == j, index[:, None], chosen_experts)
        remaining = tl.where(expert_ids[None, :] == index[:, None], -2.0, remaining)
    if RENORMALIZE:
        total = tl.maximum(tl.sum(chosen_weights, axis=1), 1e-30)  # 0 for NaN rows
        chosen_weights = chosen_weights / total[:, None]
    at = tokens[:, None] * TOP_K + slots[None, :]
    keep = token_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + at, chosen_weights, mask=keep)
    tl.store(experts_ptr + at, chosen_experts, mask=keep)


@triton_jit(do_not_specialize=("num_tokens",))
def _route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKEN_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    route_tokens(
        logits_ptr,
        weights_ptr,
        experts_ptr,
        tl.program_id(0) * TOKEN_CHUNK,
        num_tokens,
        stride_logits,
        NUM_EXPERTS,
        TOP_K,
        BLOCK_E,
        BLOCK_K,
        RENORMALIZE,
        TOKEN_CHUNK,
    )


def token_chunk(num_tokens: int, block_e: int) -> int:
    """Tokens a routing pass takes: one for a batch-1 decode step (not a [16, E] tile of 15
    empty rows); every other count shares one size, so that none compiles a variant of its
    own."""
    return 1 if num_tokens == 1 else max(1, min(16, 2048 // block_e))


def moe_route_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    experts = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, experts
    load_triton()
    with_pdl = use_pdl(router_logits)
    block_e = next_power_of_2(num_experts)
    chunk = token_chunk(num_tokens, block_e)
    _route_kernel[(cdiv(num_tokens, chunk),)](
        router_logits,
        weights,
        experts,
        num_tokens,
        router_logits.stride(0),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        TOKEN_CHUNK=chunk,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_route"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return weights, experts


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if top_k > router_logits.shape[-1]:
        raise ValueError(f"top_k {top_k} exceeds the {router_logits.shape[-1]} experts")
    if use_triton(router_logits):
        return moe_route_triton(router_logits, top_k, renormalize)
    return moe_route_ref(router_logits, top_k, renormalize)


# --- routing and grouping in one program ------------------------------------------------


@triton_jit(do_not_specialize=("num_tokens", "max_padded"))
def _route_group_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    num_tokens,
    max_padded,
    stride_logits,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKEN_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNK_PAIRS: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    # ``_route_kernel``'s work for every token, TOKEN_CHUNK rows at a time, then the three
    # grouping kernels' work, each phase after a barrier: a later one reads what threads of
    # the one before wrote.
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    for t0 in range(0, num_tokens, TOKEN_CHUNK):
        route_tokens(
            logits_ptr,
            weights_ptr,
            experts_ptr,
            t0,
            num_tokens,
            stride_logits,
            NUM_EXPERTS,
            TOP_K,
            BLOCK_E,
            BLOCK_K,
            RENORMALIZE,
            TOKEN_CHUNK,
        )
    tl.debug_barrier()

    num_pairs = num_tokens * TOP_K
    pair_lanes = tl.arange(0, CHUNK_PAIRS)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK_PAIRS):
        in_range = start + pair_lanes < num_pairs
        ids = moe_grouping.load_experts(experts_ptr, start + pair_lanes, in_range, NUM_EXPERTS)
        counts += moe_grouping.count_experts(ids, in_range, BLOCK_E)
    # Helpers by module attribute: Triton resolves those to the compiled functions.
    moe_grouping.write_runs(
        counts,
        cursor_ptr,
        block_expert_ptr,
        num_padded_ptr,
        max_padded,
        BLOCK_M,
        NUM_EXPERTS,
        BLOCK_E,
        CHUNK,
    )
    for start in range(0, max_padded, CHUNK_PAIRS):
        rows = start + pair_lanes
        tl.store(sorted_pairs_ptr + rows, num_pairs + 0 * rows, mask=rows < max_padded)
    tl.debug_barrier()

    for start in range(0, num_pairs, CHUNK_PAIRS):
        pairs = start + pair_lanes
        moe_grouping.place_pairs(
            experts_ptr, cursor_ptr, sorted_pairs_ptr, pairs, pairs < num_pairs, NUM_EXPERTS
        )


def moe_route_and_group_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    weights, experts = moe_route_ref(router_logits, top_k, renormalize)
    return weights, experts, moe_group_ref(experts, router_logits.shape[1], block_m)


def moe_route_and_group_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    """``moe_route`` then ``moe_group``: in one kernel up to ``FUSED_ROUTING_MAX_TOKENS``
    tokens, in the routing kernel and the grouping's above."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens > FUSED_ROUTING_MAX_TOKENS:
        weights, experts = moe_route_triton(router_logits, top_k, renormalize)
        return weights, experts, moe_group_triton(experts, num_experts, block_m)
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    experts = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    sorted_pairs, block_expert, num_padded, cursor = group_buffers(
        num_tokens * top_k, num_experts, block_m, device
    )
    load_triton()
    block_e = next_power_of_2(num_experts)
    with_pdl = use_pdl(router_logits)
    _route_group_kernel[(1,)](
        router_logits,
        weights,
        experts,
        sorted_pairs,
        block_expert,
        num_padded,
        cursor,
        num_tokens,
        sorted_pairs.numel(),
        router_logits.stride(0),
        TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        TOKEN_CHUNK=token_chunk(num_tokens, block_e),
        BLOCK_M=block_m,
        NUM_EXPERTS=num_experts,
        BLOCK_E=block_e,
        CHUNK=block_chunk(block_e),
        CHUNK_PAIRS=PAIR_CHUNK,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_group"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return weights, experts, MoeGroups(sorted_pairs, block_expert, num_padded, block_m)
