"""Linear layers at 2-64 rows (decode batches): ``y = x @ weight.T``, on tensor cores.

At these rows a projection still reads its whole weight for a handful of outputs, so it is
bound by the weight's bytes. ``_skinny_gemm_kernel`` streams the weight as the wide
operand of the product: each program owns ``BLOCK_N`` output features and one contiguous
range of K, multiplies its ``[BLOCK_N, BLOCK_K]`` weight tiles by the transposed rows
(``[BLOCK_K, BLOCK_M]``, ``BLOCK_M`` the row count padded to 16, 32 or 64), and keeps a
``[BLOCK_N, BLOCK_M]`` float32 accumulator. Putting the features on the product's long side
lets Hopper's warpgroup MMA take 64-feature tiles whatever the row count.

Narrow projections (o, down: N = hidden) have too few feature tiles to fill the GPU, so K
is split over ``split_k`` programs. Each writes its partial tile to float32 scratch and
counts in at its tile's counter; the last to arrive adds every split's partial, its own
from registers, in split order (so the bits do not depend on which arrived last), and
writes the output (``kernels/attention_merge.arrive_last``, the same scheme as decode
attention's in-kernel merge). A projection is thus one launch, with no zeroed buffer and
no reduction kernel, and it launches with PDL like the rest of the step.

``SILU_MUL`` makes the gate/up projection write ``silu(gate) * up``: a program reads the
gate rows of its features and the up rows ``intermediate`` further on, keeps two
accumulators, and rounds both to the activation dtype before the epilogue, as the two
separate kernels would. ``PAIRED`` reads a K step's gate tile, up tile and activation tile
together in one loop (one load pipeline, the activations read once); otherwise the up loop
follows the gate loop. The table picks per row count: on an H200 (Qwen3-4B, weights out of
L2) paired took 27.5 against 29.1 us at 8 rows, and lost at 32 (29.9 against 27.5), where
its larger stages leave fewer programs resident.

``groups`` divides the features evenly over that many programs a split, each in a
``BLOCK_N`` tile whose padding is masked out of the loads: a grid of one program per SM (the
H200 table's gate/up; its notes say what it gained and where groups lost).

A projection can also end in the residual add of a pending RMSNorm, or apply one on its
way in (``ADD_NORM`` and ``NORMED``, kernels/pending_norm.py). When it lets the next kernel
launch (PDL) is ``pdl.launches_successor_early``'s choice.

``linear_ref`` and ``linear_silu_and_mul_ref`` are the references. Which tile and split a
shape takes comes from ``kernels/linear_configs.py``. On an H200 (Qwen3-4B, CUDA graphs,
weights out of L2) it beat cuBLAS at 8 and 32 rows on every projection: o 8.4 against 9.7 us
at 8 rows, down 15.7 against 16.9, gate/up with silu-and-mul 28.8 against 30.8 (cuBLAS and
the activation kernel), qkv 10.8 against 11.3; at 64 rows cuBLAS wins the narrow ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import pdl, skinny_tile
from kernels.attention_merge import split_counters
from kernels.backend import (
    cdiv,
    dot_needs_fp32,
    load_triton,
    output_rows,
    triton_jit,
    use_pdl,
    weight_eviction,
)
from kernels.pending_norm import PendingNorm

if TYPE_CHECKING:
    from kernels.linear import LinearConfig

tl = None  # bound to triton.language by kernels.backend.load_triton()

MAX_ROWS = 64


# Two kernels over one body, so that a profile tells the gate/up projection that ends in
# silu-and-mul (the down projection follows it directly) from the others. The row count and
# the split are not specialized on: one compiled variant serves every batch of a padded size.
_NO_SPECIALIZE = ("M", "num_splits")


@triton_jit(do_not_specialize=_NO_SPECIALIZE)
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    norm_w_ptr,
    weighted_ptr,
    in_sums_ptr,
    residual_ptr,
    out_sums_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    num_in_groups,
    eps,
    HAS_BIAS: tl.constexpr,
    NORMED: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    ADD_NORM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    PREFETCH_TILES: tl.constexpr,
    W_EVICT: tl.constexpr,
    BALANCED: tl.constexpr,
):
    skinny_tile.skinny_gemm_tile(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        partial_ptr,
        counters_ptr,
        norm_w_ptr,
        weighted_ptr,
        in_sums_ptr,
        residual_ptr,
        out_sums_ptr,
        M,
        N,
        K,
        k_per_split,
        num_splits,
        stride_x_row,
        stride_w_row,
        stride_out_row,
        num_in_groups,
        eps,
        HAS_BIAS,
        False,
        NORMED,
        IN_GROUPS,
        ADD_NORM,
        SPLIT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        DOT_FP32,
        USE_PDL,
        True,
        LAUNCH_SUCCESSOR,
        PREFETCH_TILES,
        W_EVICT,
        BALANCED,
    )


@triton_jit(do_not_specialize=_NO_SPECIALIZE)
def _skinny_gemm_silu_and_mul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    norm_w_ptr,
    weighted_ptr,
    in_sums_ptr,
    residual_ptr,
    out_sums_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    num_in_groups,
    eps,
    HAS_BIAS: tl.constexpr,
    NORMED: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    ADD_NORM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIRED: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    W_EVICT: tl.constexpr,
    BALANCED: tl.constexpr,
):
    skinny_tile.skinny_gemm_tile(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        partial_ptr,
        counters_ptr,
        norm_w_ptr,
        weighted_ptr,
        in_sums_ptr,
        residual_ptr,
        out_sums_ptr,
        M,
        N,
        K,
        k_per_split,
        num_splits,
        stride_x_row,
        stride_w_row,
        stride_out_row,
        num_in_groups,
        eps,
        HAS_BIAS,
        True,
        NORMED,
        IN_GROUPS,
        ADD_NORM,
        SPLIT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        DOT_FP32,
        USE_PDL,
        PAIRED,
        LAUNCH_SUCCESSOR,
        0,
        W_EVICT,
        BALANCED,
    )


def block_rows(num_rows: int) -> int:
    """The padded row count of a ``num_rows`` launch: 16, 32 or 64."""
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    split_k: int,
    num_warps: int = 4,
    num_stages: int = 4,
    silu_mul: bool = False,
    normed: PendingNorm | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    paired: bool = False,
    prefetch_tiles: int = 0,
    groups: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K] @ weight [N, K].T (+ bias) -> [M, N]`` for ``1 <= M <= 64``; with
    ``silu_mul``, ``weight`` is ``[gate | up]`` (``2 * n`` rows, no bias) and the result
    ``silu(gate) * up``; ``paired`` then reads the gate and up rows in one K loop.

    With ``normed`` (whose weighted stream is ``x``) the pending RMSNorm's row scale is
    applied. With ``residual [M, N]`` and ``norm_weight [N]`` the result is ``(s, square
    sums [M, tiles], s * norm_weight)`` for ``s = round(x @ weight.T) + residual``: what the
    norm that follows needs (kernels/pending_norm.py). A plain projection may read
    ``prefetch_tiles`` weight tiles of its split before the PDL wait.

    ``groups`` > 0 divides the N features evenly over that many programs a split, each at
    most ``block_n``, instead of tiles of ``block_n``. A projection with no residual add
    writes into ``out`` when given."""
    num_rows, k = x.shape
    if not 0 < num_rows <= MAX_ROWS:
        raise ValueError(f"the skinny GEMM takes 1-{MAX_ROWS} rows, got {num_rows}")
    if weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {k} unit-stride features")
    n = weight.shape[0]
    if silu_mul:
        if n % 2:
            raise ValueError(f"weight {tuple(weight.shape)} is no [gate | up] pair")
        n //= 2
        if bias is not None:
            raise ValueError("silu_mul takes no bias")
    if residual is not None and (silu_mul or bias is not None or out is not None):
        raise ValueError("the residual add takes a plain projection with no bias or out")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = output_rows(out, num_rows, n, x)
    load_triton()
    block_m = block_rows(num_rows)
    split_k = max(1, min(split_k, cdiv(k, block_k)))
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k
    split_k = cdiv(k, k_per_split)
    num_tiles = cdiv(n, block_n)
    if groups:
        if cdiv(n, groups) > block_n or groups > n:
            raise ValueError(f"{groups} groups of at most {block_n} cannot cover {n} features")
        num_tiles = groups
    if split_k > 1:
        parts = 2 if silu_mul else 1
        partial = torch.empty(
            split_k * num_tiles * parts * block_n * block_m, dtype=torch.float32, device=x.device
        )
        counters = split_counters(num_tiles, x.device)
    else:
        partial = counters = out  # unused
    out_sums = weighted = None
    if residual is not None:
        if norm_weight is None:
            raise ValueError("the residual add needs the norm's weight")
        residual = residual.contiguous()
        out_sums = torch.empty((num_rows, num_tiles), dtype=torch.float32, device=x.device)
        weighted = torch.empty_like(out)
    with_pdl = use_pdl(x)
    kernel = _skinny_gemm_silu_and_mul_kernel if silu_mul else _skinny_gemm_kernel
    kernel[(num_tiles, split_k)](
        x,
        weight,
        bias if bias is not None else x,
        out,
        partial,
        counters,
        norm_weight if norm_weight is not None else x,
        weighted if weighted is not None else x,
        normed.square_sums if normed is not None else x,
        residual if residual is not None else x,
        out_sums if out_sums is not None else x,
        num_rows,
        n,
        k,
        k_per_split,
        split_k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        normed.num_groups if normed is not None else 1,
        normed.eps if normed is not None else 0.0,
        HAS_BIAS=bias is not None,
        NORMED=normed is not None,
        IN_GROUPS=normed.groups_block if normed is not None else 1,
        ADD_NORM=residual is not None,
        SPLIT=split_k > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        DOT_FP32=dot_needs_fp32(x.dtype),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(
            with_pdl, "skinny_add" if residual is not None else "skinny"
        ),
        W_EVICT=weight_eviction(),
        BALANCED=groups > 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **({"PAIRED": paired} if silu_mul else {}),
        **({} if silu_mul else {"PREFETCH_TILES": prefetch_tiles}),
        **pdl.launch_options(with_pdl),
    )
    return out if out_sums is None else (out, out_sums, weighted)


def _tile(config: LinearConfig) -> dict[str, int]:
    """``skinny_gemm``'s tile arguments from a ``LinearConfig`` (kernels/linear_configs.py)."""
    return {
        "block_n": config.block_n,
        "block_k": config.block_k,
        "split_k": config.split_k,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        "groups": config.groups,
    }


def skinny_gemm_with(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    silu_mul: bool = False,
    normed: PendingNorm | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``skinny_gemm`` with the tile of a ``LinearConfig``."""
    result = skinny_gemm(
        x, weight, bias, silu_mul=silu_mul, normed=normed, paired=config.paired, out=out,
        **_tile(config),
    )  # fmt: skip
    assert isinstance(result, torch.Tensor)
    return result


def skinny_gemm_add_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    config: LinearConfig,
    prefetch_tiles: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``skinny_gemm`` ending in the residual add, with a ``LinearConfig``'s tile."""
    out = skinny_gemm(
        x,
        weight,
        None,
        residual=residual,
        norm_weight=norm_weight,
        prefetch_tiles=prefetch_tiles,
        **_tile(config),
    )
    assert isinstance(out, tuple)
    return out
