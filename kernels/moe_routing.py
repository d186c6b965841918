"""Mixture-of-experts routing: each token's top-k experts and their weights, and the
grouping of (token, expert) pairs by expert that the grouped GEMMs of kernels/fused_moe.py
read.

Routing is a softmax over the router's logits, the ``top_k`` largest probabilities, and
(``renormalize``) those divided by their sum. The grouping lays the pairs out expert by
expert, each expert's run padded to a multiple of ``block_m`` rows, so that every block of
``block_m`` rows belongs to one expert and a GEMM program reads that expert's weight tiles
once for the whole block. Both run on the device without a host synchronisation and with
shapes fixed by the token count alone, so a decode step keeps them inside its CUDA graph.

Up to ``FUSED_ROUTING_MAX_TOKENS`` tokens (decode batches) one single-program kernel routes
and groups: a step of a sparse layer then launches one kernel for both instead of two.

The layout (``MoeGroups``), for ``P = tokens * top_k`` pairs numbered ``token * top_k + j``:
- ``sorted_pairs [max_padded]``: pair numbers, expert by expert, each expert's pairs first in
  its run (in no set order on a GPU; rising in the reference), padding rows after, holding
  ``P``;
- ``block_expert [max_blocks]``: the expert of each block of rows, -1 past the last used
  block;
- ``num_padded [1]``: the rows in use, a multiple of ``block_m``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import pdl
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()


FUSED_ROUTING_MAX_TOKENS = 64


@dataclass(frozen=True)
class MoeGroups:
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the grouping may use: each expert used pads at most ``block_m - 1`` rows, and
    at most ``num_pairs`` experts are used."""
    used = min(num_pairs, num_experts)
    return cdiv(num_pairs + used * (block_m - 1), block_m) * block_m


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


@triton_jit(do_not_specialize=("num_tokens",))
def _route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    num_tokens,
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    # One program a token: the experts fit one tile, and top-k is k rounds of arg-max.
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(
        logits_ptr + token * stride_logits + offs, mask=offs < num_experts, other=float("-inf")
    ).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    # A row of NaN (a padding row of a graph, say) would match no expert: it gets the first
    # ones at weight 0 instead, so every expert id stays in range.
    probs = tl.where(probs == probs, probs, 0.0)
    remaining = tl.where(offs < num_experts, probs, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_experts = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        # The lowest index among equal probabilities, as a stable top-k picks.
        index = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        chosen_weights = tl.where(slots == j, best, chosen_weights)
        chosen_experts = tl.where(slots == j, index, chosen_experts)
        remaining = tl.where(offs == index, -2.0, remaining)
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.maximum(tl.sum(chosen_weights, axis=0), 1e-30)
    keep = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=keep)
    tl.store(experts_ptr + token * TOP_K + slots, chosen_experts, mask=keep)


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
    _route_kernel[(num_tokens,)](
        router_logits,
        weights,
        experts,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        BLOCK_E=next_power_of_2(num_experts),
        BLOCK_K=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_route"),
        num_warps=4 if num_experts > 256 else 1,
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


# --- grouping by expert ----------------------------------------------------------------


def moe_group_ref(experts: torch.Tensor, num_experts: int, block_m: int) -> MoeGroups:
    device = experts.device
    flat = experts.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - run_start[flat[order]]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[flat[order]] + rank] = order.to(torch.int32)
    num_padded = padded.sum().reshape(1)
    block_rows = torch.arange(max_padded // block_m, device=device) * block_m
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), block_rows, right=True)
    block_expert = torch.where(block_rows < num_padded, block_expert, -1).to(torch.int32)
    return MoeGroups(sorted_pairs, block_expert, num_padded.to(torch.int32), block_m)


@triton_jit(do_not_specialize=("num_pairs", "max_padded", "num_tokens"))
def _group_kernel(
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    cursor_ptr,
    num_pairs,
    max_padded,
    logits_ptr,
    weights_ptr,
    num_tokens,
    stride_logits,
    BLOCK_M: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PAIR_CHUNK: tl.constexpr,
    ROUTE: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKEN_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    # One program: the pairs are few (tokens x top_k) and every placement depends on the
    # counts of all of them. Experts' counts go through one-hot [CHUNK, BLOCK_E] tiles.
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    expert_ids = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    if ROUTE:
        # ``_route_kernel``'s work for every token, TOKEN_CHUNK rows at a time; the experts
        # chosen are read back below, after a barrier.
        slots = tl.arange(0, BLOCK_K)
        for t0 in range(0, num_tokens, TOKEN_CHUNK):
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
            probs = tl.where(probs == probs, probs, 0.0)  # as in _route_kernel
            remaining = tl.where(expert_ids[None, :] < NUM_EXPERTS, probs, -1.0)
            chosen_weights = tl.zeros([TOKEN_CHUNK, BLOCK_K], dtype=tl.float32)
            chosen_experts = tl.zeros([TOKEN_CHUNK, BLOCK_K], dtype=tl.int32)
            for j in tl.static_range(TOP_K):
                best = tl.max(remaining, axis=1)
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
        tl.debug_barrier()
    # Counts by histogram (shared-memory atomics); a lane past the last pair reads expert 0
    # and is taken back out of its bin.
    pair_lanes = tl.arange(0, PAIR_CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, PAIR_CHUNK):
        in_range = start + pair_lanes < num_pairs
        ids = tl.load(experts_ptr + start + pair_lanes, mask=in_range, other=0)
        # Ids index the cursors below: one out of range must not write past them.
        ids = tl.minimum(tl.maximum(ids, 0), NUM_EXPERTS - 1)
        counts += tl.histogram(ids, BLOCK_E)
        outside = tl.sum((~in_range).to(tl.int32), axis=0)
        counts -= tl.where(expert_ids == 0, outside, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + expert_ids, padded_start, mask=expert_ids < NUM_EXPERTS)

    for start in range(0, max_padded, PAIR_CHUNK):
        rows = start + pair_lanes
        tl.store(
            sorted_pairs_ptr + rows,
            tl.zeros([PAIR_CHUNK], dtype=tl.int32) + num_pairs,
            mask=rows < max_padded,
        )
    for start in range(0, max_padded // BLOCK_M, CHUNK):
        blocks = start + lanes
        block_rows = blocks * BLOCK_M
        ended = (padded_end[None, :] <= block_rows[:, None]) & (expert_ids[None, :] < NUM_EXPERTS)
        owner = tl.sum(ended.to(tl.int32), axis=1)
        owner = tl.where(block_rows < total, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_padded // BLOCK_M)
    # The padding and cursor stores above and the placements below may hit one address from
    # two threads.
    tl.debug_barrier()

    # Each pair takes the next row of its expert's run. Which of an expert's rows a pair
    # gets depends on the order the atomics land in, not what is computed for it: each row of
    # the grouped GEMMs is its pair's own.
    for start in range(0, num_pairs, PAIR_CHUNK):
        pairs = start + pair_lanes
        in_range = pairs < num_pairs
        ids = tl.load(experts_ptr + pairs, mask=in_range, other=0)
        ids = tl.minimum(tl.maximum(ids, 0), NUM_EXPERTS - 1)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=in_range)
        tl.store(sorted_pairs_ptr + row, pairs, mask=in_range)


def _launch_group(
    experts: torch.Tensor,
    num_experts: int,
    block_m: int,
    route: tuple[torch.Tensor, torch.Tensor, int, bool] | None,
) -> MoeGroups:
    """The grouping kernel over ``experts`` (``[P]`` int32); with ``route = (logits,
    weights, top_k, renormalize)`` it first writes ``experts`` and ``weights`` itself."""
    device = experts.device
    num_pairs = experts.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    load_triton()
    block_e = next_power_of_2(num_experts)
    logits, weights, top_k, renormalize = route or (experts, experts, 1, False)
    with_pdl = use_pdl(experts)
    _group_kernel[(1,)](
        experts,
        sorted_pairs,
        block_expert,
        num_padded,
        cursor,
        num_pairs,
        max_padded,
        logits,
        weights,
        logits.shape[0] if route else 0,
        logits.stride(0) if route else 0,
        BLOCK_M=block_m,
        NUM_EXPERTS=num_experts,
        BLOCK_E=block_e,
        CHUNK=max(16, min(64, 8192 // block_e)),
        PAIR_CHUNK=512,
        ROUTE=route is not None,
        TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        # A batch-1 decode step routes one token, not a [16, E] tile of 15 empty rows; every
        # other count shares one variant, so that no token count compiles one of its own.
        TOKEN_CHUNK=1 if logits.shape[0] == 1 else max(1, min(16, 2048 // block_e)),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_group"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return MoeGroups(sorted_pairs, block_expert, num_padded, block_m)


def moe_group_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> MoeGroups:
    flat = experts.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    return _launch_group(flat, num_experts, block_m, None)


def moe_route_and_group_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    weights, experts = moe_route_ref(router_logits, top_k, renormalize)
    return weights, experts, moe_group_ref(experts, router_logits.shape[1], block_m)


def moe_route_and_group_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    """``moe_route`` then ``moe_group``: in one kernel up to ``FUSED_ROUTING_MAX_TOKENS``
    tokens, in two above."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens > FUSED_ROUTING_MAX_TOKENS:
        weights, experts = moe_route_triton(router_logits, top_k, renormalize)
        return weights, experts, moe_group_triton(experts, num_experts, block_m)
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    experts = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    route = (router_logits, weights, top_k, renormalize)
    groups = _launch_group(experts.view(-1), num_experts, block_m, route)
    return weights, experts, groups


def moe_group(experts: torch.Tensor, num_experts: int, block_m: int) -> MoeGroups:
    """Group the ``[T, top_k]`` pairs of ``experts`` by expert (see the module's layout)."""
    if use_triton(experts):
        return moe_group_triton(experts, num_experts, block_m)
    return moe_group_ref(experts, num_experts, block_m)
