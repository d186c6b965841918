"""An RMSNorm whose statistics are known but which is not yet applied (``PendingNorm``).

A decoder layer's residual add and RMSNorm sit between two projections: o or down produces
the sublayer output, the norm of ``output + residual`` feeds qkv or gate/up. At decode
batch sizes the norm is a kernel of its own that moves a few KB and costs a launch, a drain
and a ramp, 72 times a step on Qwen3-4B. Here it is split over the two projections around it:

- the producing projection ends in the residual add: it rounds its output to the dtype,
  adds the residual, stores the rounded sum (the new residual stream) and that sum times the
  norm's weight, and writes each row's sum of squares over its features to one slot per
  group of programs (``add_residual_and_square``). The slots are plain stores, so the total
  does not depend on the order in which programs finish, and no buffer has to be zeroed;
- the consuming projection reads the weighted stream as its input, unchanged, so its loads
  pipeline as before; it reads the rows' slots once (``inverse_rms``) and scales its
  accumulated rows by ``1 / rms`` at the end.

That is the reference's function with its roundings in another place: the reference rounds
``x / rms * weight`` to the dtype before the product, the fused pair rounds ``x * weight``.
Multiplying each activation tile by the weight inside the consumer instead, on its way to
the tensor cores, made the skinny GEMM's loads wait: on an H200 decode steps at 8 and 32
rows took 17% and 25% longer than with the norm kernel.

A mixture of experts' layer (kernels/sparse_mlp.py) produces one from its experts' sum and
consumes one in its router and its first grouped GEMM, which scales its rows by ``1 / rms``
before the activation.

``PendingNorm`` carries the stream, the norm's weight and eps, and the slots between the
two calls. Any consumer that cannot take it calls ``materialize()``, a plain RMSNorm of the
stream, so a shape or a device the fused kernels do not cover still gets the exact norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import attention_merge
from kernels.backend import next_power_of_2, triton_jit
from kernels.rmsnorm import rms_norm

tl = None  # bound to triton.language by kernels.backend.load_triton()


@dataclass(frozen=True)
class PendingNorm:
    """``rms_norm(hidden, weight, eps)``, still to be applied by the next projection.

    ``square_sums [rows, groups]`` float32 holds partial sums of ``hidden ** 2`` along the
    features; their total over the groups is each row's full sum. ``weighted`` is
    ``hidden * weight`` rounded to the dtype: the norm but for its ``1 / rms`` row scale."""

    hidden: torch.Tensor
    weight: torch.Tensor
    eps: float
    square_sums: torch.Tensor
    weighted: torch.Tensor

    @property
    def num_groups(self) -> int:
        return self.square_sums.shape[1]

    @property
    def groups_block(self) -> int:
        """The power-of-two tile a consumer loads the slots of a row in."""
        return next_power_of_2(self.num_groups)

    def groups_block_for_row(self, num_warps: int) -> int:
        """``groups_block`` for a one-row consumer of ``num_warps`` warps: at least one slot a
        thread. Narrower, Triton spreads the tile over the program's threads in a layout that
        holds registers through the whole K loop: compiled for sm_90 by Triton 3.6, the
        Qwen3-4B qkv GEMV (2 warps) took 51 registers with 20 slots read as 32 against 37
        with 64, so 18 programs a SM instead of 25 and two waves instead of one: a batch-1
        decode step went from 2.43 to 3.04 ms on an H200 when o and down wrote 20 slots; at
        Qwen3-8B's shape (64 slots, 4-warp programs, 67 registers) the qkv GEMV took 135 us a
        layer against 14, and a step 8.5 against 4.2 ms."""
        return max(self.groups_block, 32 * num_warps)

    def materialize(self) -> torch.Tensor:
        return rms_norm(self.hidden, self.weight, self.eps)


def as_tensor(x: torch.Tensor | PendingNorm) -> torch.Tensor:
    """``x`` itself, or the norm it stands for applied."""
    return x.materialize() if isinstance(x, PendingNorm) else x


@triton_jit
def add_residual_and_square(
    y, residual_ptrs, out_ptrs, norm_weight, weighted_ptrs, mask, FEATURE_AXIS: tl.constexpr
):
    """Store ``s = round(round(y) + residual)`` at ``out_ptrs`` and ``round(s * norm_weight)``
    at ``weighted_ptrs``; return the sums of ``s ** 2`` along ``FEATURE_AXIS`` of the tile
    (one per row), float32.

    ``y`` is a float32 projection tile. It is rounded to the stream's dtype first, as the
    stored projection the separate add+RMSNorm kernel would read, and the norm is taken of
    exactly the rounded sum that the next layer adds back. ``norm_weight`` (float32) is
    broadcast along the tile's other axis."""
    residual = tl.load(residual_ptrs, mask=mask, other=0.0)
    return add_loaded_residual_and_square(
        y, residual, out_ptrs, norm_weight, weighted_ptrs, mask, FEATURE_AXIS
    )


@triton_jit
def add_loaded_residual_and_square(
    y, residual, out_ptrs, norm_weight, weighted_ptrs, mask, FEATURE_AXIS: tl.constexpr
):
    """``add_residual_and_square`` with the residual tile already loaded (masked with 0), so
    that a kernel can issue its load ahead of a round trip of its own."""
    out_type = out_ptrs.dtype.element_ty
    summed = (y.to(out_type).to(tl.float32) + residual.to(tl.float32)).to(out_type)
    tl.store(out_ptrs, summed, mask=mask)
    value = tl.where(mask, summed.to(tl.float32), 0.0)
    tl.store(weighted_ptrs, (value * norm_weight).to(out_type), mask=mask)
    return tl.sum(value * value, axis=FEATURE_AXIS)


@triton_jit
def load_square_sums(sums_ptr, rows, row_mask, num_groups, stride_sums_row, GROUPS: tl.constexpr):
    """The rows' ``[rows, GROUPS]`` slots of sums of squares, 0 past ``num_groups``.

    A consumer issues this load before its main loop and reduces it with ``inverse_rms``
    after: used at once, its L2 round trip would hold back the loop's first weight loads in
    every program. Read past L1 (``.cg``): the producing kernel wrote the slots from other
    SMs."""
    groups = tl.arange(0, GROUPS)
    return tl.load(
        sums_ptr + rows.to(tl.int64)[:, None] * stride_sums_row + groups[None, :],
        mask=row_mask[:, None] & (groups < num_groups)[None, :],
        other=0.0,
        cache_modifier=".cg",
    )


@triton_jit
def inverse_rms(square_sums, hidden, eps):
    """``1 / sqrt(mean square + eps)`` of each row, from ``load_square_sums``."""
    return 1.0 / tl.sqrt(tl.sum(square_sums, axis=1) / hidden + eps)


@triton_jit
def sum_group_squares(
    squares, rows, row_mask, tile_sums_ptr, out_sums_ptr, counters_ptr, GROUP_TILES: tl.constexpr
):
    """Put this feature tile's per-row sums of squares in its slot; the last tile of each
    group of ``GROUP_TILES`` to finish adds the group's slots and writes the group's slot of
    ``out_sums [M, groups]``. A one-row GEMV has over a thousand tiles: the consumer then
    reads one slot per group, not per tile."""
    tile = tl.program_id(1)
    num_tiles = tl.num_programs(1)
    num_groups = (num_tiles + GROUP_TILES - 1) // GROUP_TILES
    group = tile // GROUP_TILES
    tile_rows = rows.to(tl.int64) * num_tiles
    if GROUP_TILES == 1:
        tl.store(out_sums_ptr + tile_rows + tile, squares, mask=row_mask)
        return
    tl.store(tile_sums_ptr + tile_rows + tile, squares, mask=row_mask)
    counter = counters_ptr + tl.program_id(0) * num_groups + group
    in_group = tl.minimum(GROUP_TILES, num_tiles - group * GROUP_TILES)
    if attention_merge.arrive_last(counter, in_group):
        members = group * GROUP_TILES + tl.arange(0, GROUP_TILES)
        parts = tl.load(
            tile_sums_ptr + tile_rows[:, None] + members[None, :],
            mask=row_mask[:, None] & (members < num_tiles)[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        tl.store(
            out_sums_ptr + rows.to(tl.int64) * num_groups + group,
            tl.sum(parts, axis=1),
            mask=row_mask,
        )
        tl.store(counter, 0)  # ready for the next launch (or graph replay)
