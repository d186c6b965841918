"""Routing and grouping in one kernel, as a sparse layer's decode step runs them: each token's
top-k experts (kernels/moe_routing.py) and the (token, expert) pairs laid out expert by
expert for the grouped GEMMs (kernels/moe_grouping.py's ``MoeGroups``).

Both kernels here are one program, with shapes fixed by the token count alone:
- up to ``PAIRS_IN_REGISTERS`` pairs (a few decode rows) the layout is computed in
  registers: each pair's place in its expert's run is the number of earlier pairs of that
  expert, each run's start the padded runs of the lower experts, all from pair-by-pair
  comparisons. No atomics, one read of the routed experts back, and each expert's pairs
  come in rising order, as in the reference;
- up to ``FUSED_ROUTING_MAX_TOKENS`` tokens the pairs go through memory: counted, the runs
  laid out, then each pair placed by an atomic on its expert's cursor, each phase after a
  barrier.
Above, the routing kernel and the grouping's three parallel kernels run.
"""

from __future__ import annotations

import os

import torch

from kernels import moe_grouping, moe_routing, pdl
from kernels.backend import load_triton, next_power_of_2, triton_jit, use_pdl
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
# Pairs (tokens times top_k) the register kernel takes: its comparisons are [pairs, pairs]
# and [blocks, pairs] tiles.
PAIRS_IN_REGISTERS = 64
# Rows of padding past the runs written a pass.
TAIL_CHUNK = 256


@triton_jit
def group_pairs(
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    max_padded,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_BLOCKS: tl.constexpr,
    TAIL_CHUNK: tl.constexpr,
):
    """Lay out the routed pairs at ``experts_ptr`` (written by this program, before a
    barrier) expert by expert, in registers: ``MoeGroups``' rows, runs and padding."""
    # The grouping reads the experts back, once as a column and once as a row: each pair is
    # taken against every other in [pairs, pairs] tiles, and values of a pair p stay [P, 1]
    # columns, of a pair q [1, P] rows, so that no value moves between register layouts.
    # Flattening the routed [tokens, top_k] tile in registers instead (tl.reshape, then
    # both orientations of it) grouped wrongly on an H100 under Triton 3.6, though not in
    # the interpreter.
    lanes = tl.arange(0, BLOCK_P)
    p = lanes[:, None]
    q = lanes[None, :]
    ids_p = tl.load(experts_ptr + p, mask=p < num_pairs, other=BLOCK_E)
    ids_q = tl.load(experts_ptr + q, mask=q < num_pairs, other=BLOCK_E)
    same = (ids_p == ids_q).to(tl.int32)
    # A pair's place in its expert's run is the count of that expert's pairs before it.
    rank_p = tl.sum(tl.where(q < p, same, 0), axis=1, keep_dims=True)
    rank_q = tl.sum(tl.where(p < q, same, 0), axis=0, keep_dims=True)
    count_p = tl.sum(same, axis=1, keep_dims=True)
    padded_p = (count_p + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_q = (tl.sum(same, axis=0, keep_dims=True) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first_p = (p < num_pairs) & (rank_p == 0)
    first_q = (q < num_pairs) & (rank_q == 0)
    # A run starts past the padded runs of the lower experts, each counted at its first pair.
    start_p = tl.sum(tl.where(first_q & (ids_q < ids_p), padded_q, 0), axis=1, keep_dims=True)
    start_q = tl.sum(tl.where(first_p & (ids_p < ids_q), padded_p, 0), axis=0, keep_dims=True)
    total = tl.sum(tl.sum(tl.where(first_q, padded_q, 0), axis=1), axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(sorted_pairs_ptr + start_p + rank_p, p, mask=p < num_pairs)
    # Padding, rows no pair takes, so no barrier orders these stores after the pairs': each
    # run's from its first pair, then every row past the runs.
    pad_rows = start_p + count_p + tl.arange(0, BLOCK_M)[None, :]
    pad_mask = first_p & (pad_rows < start_p + padded_p)
    tl.store(sorted_pairs_ptr + pad_rows, num_pairs + 0 * pad_rows, mask=pad_mask)
    for row0 in range(0, max_padded, TAIL_CHUNK):
        rows = row0 + tl.arange(0, TAIL_CHUNK)
        tail = (rows >= total) & (rows < max_padded)
        tl.store(sorted_pairs_ptr + rows, num_pairs + 0 * rows, mask=tail)
    block_rows = tl.arange(0, BLOCK_BLOCKS)[:, None] * BLOCK_M
    owns = first_q & (start_q <= block_rows) & (block_rows < start_q + padded_q)
    owner = tl.max(tl.where(owns, ids_q, -1), axis=1, keep_dims=True)
    tl.store(block_expert_ptr + block_rows // BLOCK_M, owner, mask=block_rows < max_padded)


@triton_jit(do_not_specialize=("num_tokens", "max_padded"))
def _route_pairs_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_tokens,
    max_padded,
    stride_logits,
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
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    moe_routing.route_tokens(
        logits_ptr,
        weights_ptr,
        experts_ptr,
        0,
        num_tokens,
        stride_logits,
        NUM_EXPERTS,
        TOP_K,
        BLOCK_E,
        BLOCK_K,
        RENORMALIZE,
        BLOCK_T,
        "",
    )

    tl.debug_barrier()
    group_pairs(
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
        moe_routing.route_tokens(
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
            "",
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
    weights, experts = moe_routing.moe_route_ref(router_logits, top_k, renormalize)
    return weights, experts, moe_group_ref(experts, router_logits.shape[1], block_m)


def pairs_in_registers(num_tokens: int, top_k: int) -> bool:
    """Whether the register kernel routes and groups these tokens
    (``PEGAINFER_MOE_REGISTER_PAIRS=0``: never)."""
    if os.environ.get("PEGAINFER_MOE_REGISTER_PAIRS", "1") == "0":
        return False
    return 0 < num_tokens * top_k <= PAIRS_IN_REGISTERS


def register_pairs_warps(num_tokens: int, top_k: int) -> int:
    """One warp while its tiles are small: every reduction of the kernel's chain of them is
    then a few shuffles, with no shared memory and no barrier between warps."""
    setting = os.environ.get("PEGAINFER_MOE_ROUTE_WARPS")
    if setting:
        return int(setting)
    return 1 if num_tokens * top_k <= 16 else 4


def moe_route_and_group_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, MoeGroups]:
    """``moe_route`` then ``moe_group``: in one kernel up to ``FUSED_ROUTING_MAX_TOKENS``
    tokens, in the routing kernel and the grouping's above."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens > FUSED_ROUTING_MAX_TOKENS:
        weights, experts = moe_routing.moe_route_triton(router_logits, top_k, renormalize)
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
    route = {
        "NUM_EXPERTS": num_experts,
        "TOP_K": top_k,
        "BLOCK_E": block_e,
        "BLOCK_K": next_power_of_2(top_k),
        "RENORMALIZE": renormalize,
        "BLOCK_M": block_m,
        "USE_PDL": with_pdl,
        "LAUNCH_SUCCESSOR": pdl.launch_successor(with_pdl, "moe_group"),
        **pdl.launch_options(with_pdl),
    }
    buffers = (router_logits, weights, experts, sorted_pairs, block_expert, num_padded)
    sizes = (num_tokens, sorted_pairs.numel(), router_logits.stride(0))
    if pairs_in_registers(num_tokens, top_k):
        _route_pairs_kernel[(1,)](
            *buffers,
            *sizes,
            BLOCK_T=next_power_of_2(num_tokens),
            BLOCK_P=next_power_of_2(num_tokens * top_k),
            BLOCK_BLOCKS=next_power_of_2(block_expert.numel()),
            TAIL_CHUNK=TAIL_CHUNK,
            num_warps=register_pairs_warps(num_tokens, top_k),
            **route,
        )
    else:
        _route_group_kernel[(1,)](
            *buffers,
            cursor,
            *sizes,
            TOKEN_CHUNK=moe_routing.token_chunk(num_tokens, block_e),
            CHUNK=block_chunk(block_e),
            CHUNK_PAIRS=PAIR_CHUNK,
            num_warps=4,
            **route,
        )
    return weights, experts, MoeGroups(sorted_pairs, block_expert, num_padded, block_m)
