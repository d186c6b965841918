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

import torch

from kernels import pdl, pending_norm
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
