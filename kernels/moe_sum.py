"""The sum over a token's experts of their weighted outputs (kernels/fused_moe.py writes one
float32 row a pair), ending in the residual add and RMSNorm that follow the sparse MLP: one
kernel instead of a sum, a cast and ``fused_add_rms_norm``.

The roundings are ``fused_add_rms_norm``'s: the sum is rounded to the dtype, added to the
residual, the rounded new residual stored and normed.

At decode rows the norm is left pending (kernels/pending_norm.py) for the next layer's qkv
projection to apply: each program then takes one slice of a token's features and writes
that slice's sum of squares to a slot of its own, so that no program has to see a whole row.
The whole-row kernel ran one program a token, which at batch 1 is one SM reading the
``top_k`` float32 rows alone: 6 us a layer of Qwen3-30B-A3B on an H100.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kernels import attention_merge, pdl, pending_norm
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl
from kernels.pending_norm import PendingNorm
from kernels.rmsnorm import fused_add_rms_norm_ref

tl = None  # bound to triton.language by kernels.backend.load_triton()


def moe_sum_add_rms_norm_ref(
    per_pair: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_pair [T, top_k, H]`` float32 summed over the experts and rounded to the
    residual's dtype, then ``fused_add_rms_norm``: ``(rms_norm(sum + residual), sum +
    residual)``."""
    return fused_add_rms_norm_ref(per_pair.sum(dim=1).to(residual.dtype), residual, weight, eps)


@triton_jit(do_not_specialize=("num_tokens",))
def _sum_add_norm_kernel(
    per_pair_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    new_residual_ptr,
    num_tokens,
    hidden,
    eps,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(per_pair_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0)
    dtype = residual_ptr.dtype.element_ty
    residual = tl.load(residual_ptr + token * hidden + cols, mask=mask, other=0.0)
    new_residual = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(new_residual_ptr + token * hidden + cols, new_residual, mask=mask)
    x = new_residual.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + token * hidden + cols, (x * inv_rms * weight).to(dtype), mask=mask)


def moe_sum_add_rms_norm_triton(
    per_pair: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, top_k, hidden = per_pair.shape
    residual = residual.contiguous()
    normed = torch.empty_like(residual)
    new_residual = torch.empty_like(residual)
    if num_tokens == 0:
        return normed, new_residual
    load_triton()
    with_pdl = use_pdl(per_pair)
    block_h = next_power_of_2(hidden)
    _sum_add_norm_kernel[(num_tokens,)](
        per_pair,
        residual,
        weight,
        normed,
        new_residual,
        num_tokens,
        hidden,
        eps,
        TOP_K=top_k,
        BLOCK_H=block_h,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_sum_add_norm"),
        num_warps=max(1, min(8, block_h // 256)),
        **pdl.launch_options(with_pdl),
    )
    return normed, new_residual


# Features a program of the pending-norm sum takes, and so the slots the next projection
# reads: Qwen3-30B-A3B's 2,048 in 32. With 8 slots (256 features) the two-row qkv GEMV,
# which loads a row's slots as they come (kernels/gemv.py, ``in_groups_block``), made a
# batch-2 decode step 6% slower than the whole-row kernel (1.84 against 1.74 ms, H100);
# with 32 it is 2% faster (1.71), and batch 1 gains 4%.
SLICE_FEATURES = 64


@triton_jit(do_not_specialize=("num_tokens",))
def _sum_add_square_kernel(
    per_pair_ptr,
    residual_ptr,
    weight_ptr,
    new_residual_ptr,
    weighted_ptr,
    square_sums_ptr,
    num_tokens,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    # The residual and the norm's weight are not the experts' outputs: read before the wait.
    residual = tl.load(residual_ptr + token * hidden + cols, mask=mask, other=0.0)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(per_pair_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0)
    squares = pending_norm.add_loaded_residual_and_square(
        total,
        residual,
        new_residual_ptr + token * hidden + cols,
        weight,
        weighted_ptr + token * hidden + cols,
        mask,
        0,
    )
    tl.store(square_sums_ptr + token * tl.num_programs(1) + part, squares)


def moe_sum_add_pending_norm_triton(
    per_pair: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> PendingNorm:
    """``moe_sum_add_rms_norm_ref`` with the norm left for the next projection: the new
    residual, its slices' sums of squares and ``new residual * weight``."""
    num_tokens, top_k, hidden = per_pair.shape
    residual = residual.contiguous()
    new_residual = torch.empty_like(residual)
    weighted = torch.empty_like(residual)
    block = min(SLICE_FEATURES, next_power_of_2(hidden))
    num_slices = cdiv(hidden, block)
    square_sums = torch.empty((num_tokens, num_slices), dtype=torch.float32, device=residual.device)
    if num_tokens:
        load_triton()
        with_pdl = use_pdl(per_pair)
        _sum_add_square_kernel[(num_tokens, num_slices)](
            per_pair,
            residual,
            weight,
            new_residual,
            weighted,
            square_sums,
            num_tokens,
            hidden,
            TOP_K=top_k,
            BLOCK=block,
            USE_PDL=with_pdl,
            LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_sum_add_norm"),
            num_warps=2,
            **pdl.launch_options(with_pdl),
        )
    return PendingNorm(new_residual, weight, eps, square_sums, weighted)


# The most tokens whose sum the down GEMM's last programs take (``SumInDown``): each feature
# tile's last program sums every token's experts over its features, alone. 0, none: not yet
# measured on a GPU against the sum kernel. ``PEGAINFER_MOE_SUM_IN_DOWN`` replaces it.
SUM_IN_DOWN_MAX_TOKENS = 0


@dataclass(frozen=True)
class SumInDown:
    """Where the down GEMM (kernels/fused_moe.py) ends in the pending-norm sum itself: for
    each tile of ``SLICE_FEATURES`` features, the last of its programs to arrive at the tile's
    counter sums the tokens' experts there, adds the residual and writes the slice's slot,
    which saves the sum's launch and its wait on the GEMM's end."""

    residual: torch.Tensor
    norm_weight: torch.Tensor
    new_residual: torch.Tensor
    weighted: torch.Tensor
    square_sums: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, residual: torch.Tensor, norm_weight: torch.Tensor) -> SumInDown:
        num_tokens, hidden = residual.shape
        residual = residual.contiguous()
        num_slices = cdiv(hidden, SLICE_FEATURES)
        return cls(
            residual,
            norm_weight,
            torch.empty_like(residual),
            torch.empty_like(residual),
            torch.empty((num_tokens, num_slices), dtype=torch.float32, device=residual.device),
            split_counters(num_slices, residual.device),
        )

    def pending(self, eps: float) -> PendingNorm:
        return PendingNorm(
            self.new_residual, self.norm_weight, eps, self.square_sums, self.weighted
        )


def sums_in_down(num_tokens: int, hidden: int, block_n: int) -> bool:
    """Whether the down GEMM of these tokens ends in the sum: at most
    ``sum_in_down_max_tokens()`` tokens, and feature tiles that are the pending norm's
    slices."""
    tiles_fit = block_n == SLICE_FEATURES and hidden % SLICE_FEATURES == 0
    return num_tokens <= sum_in_down_max_tokens() and tiles_fit


@functools.cache
def sum_in_down_max_tokens() -> int:
    """``SUM_IN_DOWN_MAX_TOKENS``, or ``PEGAINFER_MOE_SUM_IN_DOWN`` where set (read once)."""
    setting = os.environ.get("PEGAINFER_MOE_SUM_IN_DOWN", str(SUM_IN_DOWN_MAX_TOKENS))
    if not setting.isdigit():
        raise ValueError(f"PEGAINFER_MOE_SUM_IN_DOWN must be a token count, got {setting!r}")
    return int(setting)


@triton_jit
def sum_tile_when_last(
    per_pair_ptr,
    counter_ptr,
    num_arrivals,
    residual_ptr,
    norm_weight_ptr,
    new_residual_ptr,
    weighted_ptr,
    square_sums_ptr,
    num_tokens,
    hidden,
    slice_index,
    num_slices,
    cols,
    col_ok,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Count this program in at its feature tile's counter; the last of ``num_arrivals`` sums
    every token's ``TOP_K`` float32 rows there in ``_sum_add_square_kernel``'s order, adds the
    residual and writes the tile's new residual, weighted stream and slot."""
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    mask = token_ok[:, None] & col_ok[None, :]
    offsets = tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
    if attention_merge.arrive_last(counter_ptr, num_arrivals):
        tl.store(counter_ptr, 0)  # ready for the next launch (or graph replay)
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        weight = tl.load(norm_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        rows = tokens.to(tl.int64)[:, None] * TOP_K
        total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            # Past L1: the other programs wrote these rows from other SMs.
            total += tl.load(
                per_pair_ptr + (rows + j) * hidden + cols[None, :],
                mask=mask,
                other=0.0,
                cache_modifier=".cg",
            )
        squares = pending_norm.add_loaded_residual_and_square(
            total,
            residual,
            new_residual_ptr + offsets,
            weight[None, :],
            weighted_ptr + offsets,
            mask,
            1,
        )
        tl.store(square_sums_ptr + tokens * num_slices + slice_index, squares, mask=token_ok)
