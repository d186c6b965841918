"""The (token, expert) pairs of a mixture-of-experts step grouped by expert, as the grouped
GEMMs of kernels/fused_moe.py read them.

The pairs are laid out expert by expert, each expert's run padded to a multiple of
``block_m`` rows, so that every block of ``block_m`` rows belongs to one expert and a GEMM
program reads that expert's weight tiles once for the whole block. The layout (``MoeGroups``),
for ``P = tokens * top_k`` pairs numbered ``token * top_k + j``:
- ``sorted_pairs [max_padded]``: pair numbers, expert by expert, each expert's pairs first in
  its run (in no set order on a GPU; rising in the reference), padding rows after, holding
  ``P``;
- ``block_expert [max_blocks]``: the expert of each block of rows, -1 past the last used
  block;
- ``num_padded [1]``: the rows in use, a multiple of ``block_m``.

It is built on the device with shapes fixed by the token count alone, so a decode step keeps
it inside its CUDA graph. Here by three kernels over all the pairs at once: counts (a
histogram per program, added into the experts' counts), runs (one program: the padded runs,
each expert's first row, the block owners) and placement (each pair takes the next row of its
expert's run by an atomic). Which of an expert's rows a pair gets depends on the order the
atomics land in, not what is computed for it: each row of the grouped GEMMs is its pair's own.
kernels/moe_route_group.py does all of it in one program for the few pairs of a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import pdl
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

PAIR_CHUNK = 512  # pairs a program of the counting and placing kernels takes (and a pass
# of the one-program kernel)


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


@triton_jit
def load_experts(experts_ptr, pairs, in_range, NUM_EXPERTS: tl.constexpr):
    """The pairs' experts; one out of range (never from the routing kernels) is clamped, as
    it indexes the cursors the placement writes."""
    ids = tl.load(experts_ptr + pairs, mask=in_range, other=0)
    return tl.minimum(tl.maximum(ids, 0), NUM_EXPERTS - 1)


@triton_jit
def count_experts(ids, in_range, BLOCK_E: tl.constexpr):
    """A histogram of ``ids`` over the experts, lanes out of range (read as expert 0) left
    out."""
    outside = tl.sum((~in_range).to(tl.int32), axis=0)
    return tl.histogram(ids, BLOCK_E) - tl.where(tl.arange(0, BLOCK_E) == 0, outside, 0)


@triton_jit
def write_runs(
    counts,
    cursor_ptr,
    block_expert_ptr,
    num_padded_ptr,
    max_padded,
    BLOCK_M: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """From the experts' counts: the rows in use, each expert's first row (its cursor) and
    the expert of each block."""
    expert_ids = tl.arange(0, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + expert_ids, padded_end - padded, mask=expert_ids < NUM_EXPERTS)
    lanes = tl.arange(0, CHUNK)
    num_blocks = max_padded // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + lanes
        block_rows = blocks * BLOCK_M
        ended = (padded_end[None, :] <= block_rows[:, None]) & (expert_ids[None, :] < NUM_EXPERTS)
        owner = tl.where(block_rows < total, tl.sum(ended.to(tl.int32), axis=1), -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)


@triton_jit
def place_pairs(
    experts_ptr, cursor_ptr, sorted_pairs_ptr, pairs, in_range, NUM_EXPERTS: tl.constexpr
):
    ids = load_experts(experts_ptr, pairs, in_range, NUM_EXPERTS)
    row = tl.atomic_add(cursor_ptr + ids, 1, mask=in_range)
    tl.store(sorted_pairs_ptr + row, pairs, mask=in_range)


@triton_jit(do_not_specialize=("num_pairs", "max_padded"))
def _count_kernel(
    experts_ptr,
    counts_ptr,
    sorted_pairs_ptr,
    num_pairs,
    max_padded,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_PAIRS: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    # Each program counts its pairs and marks its share of the rows as padding.
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    lanes = tl.program_id(0) * CHUNK_PAIRS + tl.arange(0, CHUNK_PAIRS)
    tl.store(sorted_pairs_ptr + lanes, num_pairs + 0 * lanes, mask=lanes < max_padded)
    in_range = lanes < num_pairs
    ids = load_experts(experts_ptr, lanes, in_range, NUM_EXPERTS)
    counts = count_experts(ids, in_range, BLOCK_E)
    expert_ids = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + expert_ids, counts, mask=expert_ids < NUM_EXPERTS)


@triton_jit(do_not_specialize=("max_padded",))
def _runs_kernel(
    counts_ptr,
    cursor_ptr,
    block_expert_ptr,
    num_padded_ptr,
    max_padded,
    BLOCK_M: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    expert_ids = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + expert_ids, mask=expert_ids < NUM_EXPERTS, other=0)
    write_runs(
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


@triton_jit(do_not_specialize=("num_pairs",))
def _place_kernel(
    experts_ptr,
    cursor_ptr,
    sorted_pairs_ptr,
    num_pairs,
    NUM_EXPERTS: tl.constexpr,
    CHUNK_PAIRS: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    pairs = tl.program_id(0) * CHUNK_PAIRS + tl.arange(0, CHUNK_PAIRS)
    place_pairs(experts_ptr, cursor_ptr, sorted_pairs_ptr, pairs, pairs < num_pairs, NUM_EXPERTS)


def block_chunk(block_e: int) -> int:
    """Blocks a ``write_runs`` pass takes: a [chunk, BLOCK_E] tile of 8K elements at most."""
    return max(16, min(64, 8192 // block_e))


def group_buffers(num_pairs: int, num_experts: int, block_m: int, device: torch.device):
    """``(sorted_pairs, block_expert, num_padded, cursor)``, unwritten."""
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    return (
        torch.empty(max_padded, dtype=torch.int32, device=device),
        torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        torch.empty(num_experts, dtype=torch.int32, device=device),
    )


def moe_group_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> MoeGroups:
    flat = experts.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    num_pairs = flat.numel()
    sorted_pairs, block_expert, num_padded, cursor = group_buffers(
        num_pairs, num_experts, block_m, flat.device
    )
    max_padded = sorted_pairs.numel()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    load_triton()
    block_e = next_power_of_2(num_experts)
    with_pdl = use_pdl(flat)
    launch = {
        "USE_PDL": with_pdl,
        "LAUNCH_SUCCESSOR": pdl.launch_successor(with_pdl, "moe_group"),
        "num_warps": 4,
        **pdl.launch_options(with_pdl),
    }
    grid = (cdiv(max(num_pairs, max_padded), PAIR_CHUNK),)
    _count_kernel[grid](
        flat,
        counts,
        sorted_pairs,
        num_pairs,
        max_padded,
        NUM_EXPERTS=num_experts,
        BLOCK_E=block_e,
        CHUNK_PAIRS=PAIR_CHUNK,
        **launch,
    )
    _runs_kernel[(1,)](
        counts,
        cursor,
        block_expert,
        num_padded,
        max_padded,
        BLOCK_M=block_m,
        NUM_EXPERTS=num_experts,
        BLOCK_E=block_e,
        CHUNK=block_chunk(block_e),
        **launch,
    )
    if num_pairs:
        _place_kernel[(cdiv(num_pairs, PAIR_CHUNK),)](
            flat,
            cursor,
            sorted_pairs,
            num_pairs,
            NUM_EXPERTS=num_experts,
            CHUNK_PAIRS=PAIR_CHUNK,
            **launch,
        )
    return MoeGroups(sorted_pairs, block_expert, num_padded, block_m)


def moe_group(experts: torch.Tensor, num_experts: int, block_m: int) -> MoeGroups:
    """Group the ``[T, top_k]`` pairs of ``experts`` by expert (see the module's layout)."""
    if use_triton(experts):
        return moe_group_triton(experts, num_experts, block_m)
    return moe_group_ref(experts, num_experts, block_m)
