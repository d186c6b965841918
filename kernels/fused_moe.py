"""The experts of a mixture-of-experts MLP: for each token, the weighted sum over its top-k
experts of ``down_e(silu(gate_e(x)) * up_e(x))``.

``w13 [E, 2I, H]`` holds each expert's gate rows then its up rows, ``w2 [E, H, I]`` its down
projection. The Triton path is two grouped GEMMs over the pairs grouped by expert
(kernels/moe_grouping.py): every program takes one expert's block of ``block_m`` pairs and
reads that expert's weight tiles once for all of them. The first ends in silu-and-mul and
writes one activation row a pair; the second scales each pair's row by its routing weight
and writes it in float32, and the ``top_k`` rows of a token are summed after.

Roundings, the same in the reference: the gate and up projections are rounded to the dtype
before the activation, the activation is rounded to the dtype, and the down projections are
weighted and summed in float32, rounded once at the end.

The first GEMM may take a ``PendingNorm``'s weighted stream (kernels/pending_norm.py) and
scale each row's gate and up projections by the row's ``1 / rms`` before the activation:
the norm is a row scale, so it commutes with the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import pdl, pending_norm
from kernels.backend import (
    cdiv,
    dot_needs_fp32,
    load_triton,
    triton_jit,
    use_pdl,
    use_triton,
)
from kernels.moe_grouping import MoeGroups, moe_group
from kernels.moe_tiles import down_early_tile, moe_tiles
from kernels.pending_norm import PendingNorm

tl = None  # bound to triton.language by kernels.backend.load_triton()


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_experts: torch.Tensor,
) -> torch.Tensor:
    """``x [T, H]`` through the experts ``topk_experts [T, k]`` weighted by
    ``topk_weights [T, k]`` -> ``[T, H]`` in ``x``'s dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    experts = topk_experts.long()
    if x.is_cuda:
        # Every expert over every token, weighted by zero where not routed: no host
        # synchronisation, so a decode step with the references still captures in a graph.
        for expert in range(w13.shape[0]):
            weight = (topk_weights.float() * (experts == expert)).sum(dim=1)
            out += _expert(x, w13[expert], w2[expert]) * weight[:, None]
        return out.to(x.dtype)
    for expert in torch.unique(experts).tolist():
        tokens, slots = torch.nonzero(experts == expert, as_tuple=True)
        down = _expert(x[tokens], w13[expert], w2[expert])
        out.index_add_(0, tokens, down * topk_weights[tokens, slots].float()[:, None])
    return out.to(x.dtype)


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's float32 output for the rows of ``x``, with the kernels' roundings."""
    half = w13.shape[0] // 2
    projected = (x.float() @ w13.float().T).to(x.dtype).float()
    activation = (F.silu(projected[:, :half]) * projected[:, half:]).to(x.dtype).float()
    return activation @ w2.float().T


@triton_jit(do_not_specialize=("num_pairs",))
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_padded_ptr,
    pair_weights_ptr,
    square_sums_ptr,
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    num_norm_groups,
    stride_sums,
    eps,
    A_ROW_DIVISOR: tl.constexpr,
    NORM_GROUPS: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    EARLY_TILE: tl.constexpr = False,
):
    # ``GATED``: out = silu(a @ w[:N]^T) * (a @ w[N:2N]^T), a's rows are tokens (pair //
    # top_k). Otherwise out = (a @ w^T) * pair weight, a's rows are pairs; out is float32.
    # ``NORM_GROUPS`` > 0: ``a`` is a pending norm's weighted stream, its rows scaled by
    # 1 / rms from ``square_sums`` before the activation.
    # ``EARLY_TILE``: the layout and the first weight tile are read before the PDL wait. Only
    # for a GEMM whose layout was written two kernels back (the second, after the first):
    # its predecessor's programs have all passed their own wait, so that grouping is done.
    tl.static_assert(not (EARLY_TILE and GATED), "the early tile is the plain GEMM's")
    if not EARLY_TILE:
        pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    block = pid // num_n_blocks
    n_block = pid % num_n_blocks
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    # The three loads go out together, before the exit's branch waits on the first: every
    # block's entries exist, used or not, and an unused block reads no weight.
    num_padded = tl.load(num_padded_ptr)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pairs_ptr + rows)
    if block * BLOCK_M >= num_padded:
        return
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIVISOR).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert * stride_we
    first_k = 0
    if EARLY_TILE:
        w_first = tl.load(
            w_expert + cols[:, None] * stride_wn + ks[None, :],
            mask=col_ok[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
        first_k = BLOCK_K
    if NORM_GROUPS > 0:
        square_sums = pending_norm.load_square_sums(
            square_sums_ptr, a_rows, valid, num_norm_groups, stride_sums, NORM_GROUPS
        )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if EARLY_TILE:
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & (ks < K)[None, :],
            other=0.0,
        )
        if FP32_DOT:
            a = a.to(tl.float32)
            w_first = w_first.to(tl.float32)
        acc += tl.dot(a, tl.trans(w_first), input_precision=PRECISION)
    for k0 in range(first_k, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + kk[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_expert + cols[:, None] * stride_wn + kk[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if FP32_DOT:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
        if GATED:
            w_up = tl.load(
                w_expert + (cols + N)[:, None] * stride_wn + kk[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if FP32_DOT:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, tl.trans(w_up), input_precision=PRECISION)
    out_mask = valid[:, None] & col_ok[None, :]
    out_at = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    if GATED:
        if NORM_GROUPS > 0:
            inverse_rms = pending_norm.inverse_rms(square_sums, K, eps)[:, None]
            acc = acc * inverse_rms
            acc_up = acc_up * inverse_rms
        dtype = out_ptr.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        tl.store(out_at, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=out_mask)
    else:
        if WEIGHTED:
            acc = acc * tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        tl.store(out_at, acc, mask=out_mask)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    groups: MoeGroups,
    num_pairs: int,
    n: int,
    a_row_divisor: int,
    pair_weights: torch.Tensor | None,
    block_n: int,
    block_k: int,
    warps: int,
    normed: PendingNorm | None = None,
    early_tile: bool = False,
) -> None:
    num_blocks = groups.block_expert.shape[0]
    grid = (num_blocks * cdiv(n, block_n),)
    with_pdl = use_pdl(a)
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        groups.sorted_pairs,
        groups.block_expert,
        groups.num_padded,
        pair_weights if pair_weights is not None else out,
        normed.square_sums if normed is not None else out,
        num_pairs,
        n,
        a.shape[1],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        normed.num_groups if normed is not None else 0,
        normed.square_sums.stride(0) if normed is not None else 0,
        normed.eps if normed is not None else 0.0,
        A_ROW_DIVISOR=a_row_divisor,
        NORM_GROUPS=normed.groups_block if normed is not None else 0,
        GATED=pair_weights is None,
        WEIGHTED=pair_weights is not None,
        BLOCK_M=groups.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=dot_needs_fp32(a.dtype),
        # float32 models get IEEE products, as from the reference, not tf32's 10-bit ones.
        PRECISION="ieee" if a.dtype == torch.float32 or dot_needs_fp32(a.dtype) else "tf32",
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_grouped_gemm"),
        EARLY_TILE=early_tile,
        num_warps=warps,
        num_stages=3,
        **pdl.launch_options(with_pdl),
    )


def experts_per_pair(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    groups: MoeGroups,
    tiles: tuple[int, int, int, int],
    normed: PendingNorm | None = None,
) -> torch.Tensor:
    """Each pair's weighted expert output, ``[T, top_k, H]`` float32; ``x`` is ``normed``'s
    weighted stream where given."""
    num_tokens, hidden = x.shape
    top_k = topk_weights.shape[1]
    num_pairs = num_tokens * top_k
    _, block_n, block_k, warps = tiles
    intermediate = w13.shape[1] // 2
    activation = torch.empty((num_pairs, intermediate), dtype=x.dtype, device=x.device)
    _grouped_gemm(
        x,
        w13,
        activation,
        groups,
        num_pairs,
        intermediate,
        top_k,
        None,
        block_n,
        block_k,
        warps,
        normed,
    )
    per_pair = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(
        activation,
        w2,
        per_pair,
        groups,
        num_pairs,
        hidden,
        1,
        weights,
        block_n,
        block_k,
        warps,
        early_tile=down_early_tile(),
    )
    return per_pair.view(num_tokens, top_k, hidden)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_experts: torch.Tensor,
) -> torch.Tensor:
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles = moe_tiles(x.shape[0], x.element_size())
    load_triton()
    groups = moe_group(topk_experts, w13.shape[0], tiles[0])
    return experts_per_pair(x, w13, w2, topk_weights, groups, tiles).sum(dim=1).to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_experts: torch.Tensor,
) -> torch.Tensor:
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, topk_weights, topk_experts)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_experts)
