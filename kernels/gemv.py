"""The GEMV of one or two rows (decode): ``y = x @ weight.T (+ bias)`` on CUDA cores.

Each program owns ``BLOCK_N`` output features of ``BLOCK_M`` rows, streams their weight rows
in ``BLOCK_K`` chunks and keeps a float32 partial product per element, reduced once at the
end. Small ``BLOCK_N`` gives thousands of programs, enough loads in flight to saturate HBM
with no split over K. Its multiply-adds grow with the rows: from four rows they cost more
than the tensor cores' (kernels/skinny_gemm.py). A launch may apply a pending RMSNorm on
its way in or end in the residual add of one (kernels/pending_norm.py); ``gemv`` launches
it with a ``LinearConfig`` (kernels/linear.py) from kernels/linear_configs.py.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kernels import pdl, pending_norm, rows_tile
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, output_rows, triton_jit, use_pdl, weight_eviction
from kernels.pending_norm import PendingNorm

if TYPE_CHECKING:
    from kernels.linear import LinearConfig

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Feature tiles of a GEMV that share one slot of the sums of squares it hands to the next
# projection's norm: 1,280 tiles (Qwen3-4B's o and down) give 40 slots for it to read.
# ``PEGAINFER_NORM_GROUP_TILES=1`` gives every tile its own slot, with no arrival counters.
GROUP_TILES = 32

# CUDA's limit on a grid's second dimension, which holds the GEMV's feature tiles.
MAX_FEATURE_TILES = 65_535


def group_tiles_now() -> int:
    return int(os.environ.get("PEGAINFER_NORM_GROUP_TILES", GROUP_TILES))


@triton_jit
def weight_tile(rows, index, K, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    ks = index * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(rows + ks[None, :], mask=(ks < K)[None, :], other=0.0, eviction_policy=EVICT)


@triton_jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    norm_w_ptr,
    weighted_ptr,
    in_sums_ptr,
    residual_ptr,
    tile_sums_ptr,
    out_sums_ptr,
    counters_ptr,
    M,
    N,
    K,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    num_in_groups,
    eps,
    HAS_BIAS: tl.constexpr,
    NORMED: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    ADD_NORM: tl.constexpr,
    GROUP_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH_TILES: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    # Row tiles vary fastest, so programs sharing a weight tile run side by side and all but
    # the first read it from L2. Within a program every row uses each weight tile loaded.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    feature_mask = features < N
    # Clamped rather than masked: out-of-range rows and features re-read valid ones and
    # are never stored.
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    safe_features = tl.where(feature_mask, features, 0).to(tl.int64)
    # Weights are written before the step: the first tiles may be read before the wait
    # (kernels/linear_configs.py says when).
    if BLOCK_M == 1:
        w_rows = w_ptr + safe_features[:, None] * stride_w_row
        if PREFETCH_TILES >= 1:
            w_0 = weight_tile(w_rows, 0, K, BLOCK_K, W_EVICT)
        if PREFETCH_TILES >= 2:
            w_1 = weight_tile(w_rows, 1, K, BLOCK_K, W_EVICT)
    else:
        w_rows = w_ptr + safe_features[None, :, None] * stride_w_row
        if PREFETCH_TILES >= 1:
            w_0 = rows_tile.tile_3d(w_rows, 0, K, BLOCK_K, EVEN_K, W_EVICT)
        if PREFETCH_TILES >= 2:
            w_1 = rows_tile.tile_3d(w_rows, BLOCK_K, K, BLOCK_K, EVEN_K, W_EVICT)
    offsets = rows.to(tl.int64)[:, None] * stride_out_row + features[None, :]
    mask = row_mask[:, None] & feature_mask[None, :]
    if ADD_NORM and BLOCK_M == 1:
        norm_w = tl.load(norm_w_ptr + safe_features).to(tl.float32)[None, :]
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if NORMED:
        square_sums = pending_norm.load_square_sums(
            in_sums_ptr, rows, row_mask, num_in_groups, num_in_groups, IN_GROUPS
        )
    if ADD_NORM and BLOCK_M == 1:
        # Issued before the K loop, its round trip is not added to the epilogue's.
        residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
    if BLOCK_M == 1:
        # The accumulator keeps the weight tile's own layout, so the loop has no layout
        # conversion. The [rows, features, K] form of a 2D tile converts both tiles through
        # shared memory every step (four barriers an iteration on sm_90); at one row it made a
        # Qwen3-4B decode step 2% slower on an H200 (2.61-2.62 against 2.57 ms).
        x_rows = x_ptr + safe_rows[:, None] * stride_x_row
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH_TILES >= 1:
            acc += weight_tile(x_rows, 0, K, BLOCK_K, "").to(tl.float32) * w_0.to(tl.float32)
        if PREFETCH_TILES >= 2:
            acc += weight_tile(x_rows, 1, K, BLOCK_K, "").to(tl.float32) * w_1.to(tl.float32)
        # With LOOP_STAGES > 1 Triton copies the next tiles into shared memory asynchronously
        # while this one is summed: more bytes in flight a program without holding them in
        # registers (it pipelines loads that feed no tl.dot only when the loop asks for it).
        for k_start in tl.range(PREFETCH_TILES * BLOCK_K, K, BLOCK_K, num_stages=LOOP_STAGES):
            ks = k_start + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], eviction_policy=W_EVICT)
                x = tl.load(x_rows + ks[None, :]).to(tl.float32)
            else:
                k_mask = ks < K
                w = tl.load(
                    w_rows + ks[None, :], mask=k_mask[None, :], other=0.0, eviction_policy=W_EVICT
                )
                x = tl.load(x_rows + ks[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
            acc += x * w.to(tl.float32)
        y = tl.sum(acc, axis=1)[None, :]
    else:
        # Several rows: both tiles are loaded as 3D tensors that broadcast into one layout
        # (threads and warps along K, rows and features in registers), so neither is
        # converted in the loop.
        x_rows = x_ptr + safe_rows[:, None, None] * stride_x_row
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        if PREFETCH_TILES >= 1:
            acc = rows_tile.rows_step(x_rows, w_0, 0, K, acc, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        if PREFETCH_TILES >= 2:
            acc = rows_tile.rows_step(
                x_rows, w_1, BLOCK_K, K, acc, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K
            )
        for k_start in tl.range(PREFETCH_TILES * BLOCK_K, K, BLOCK_K, num_stages=LOOP_STAGES):
            w = rows_tile.tile_3d(w_rows, k_start, K, BLOCK_K, EVEN_K, W_EVICT)
            acc = rows_tile.rows_step(x_rows, w, k_start, K, acc, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        y = tl.sum(acc, axis=2)
    if NORMED:
        y *= pending_norm.inverse_rms(square_sums, K, eps)[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + safe_features).to(tl.float32)[None, :]
    if ADD_NORM:
        if BLOCK_M > 1:
            norm_w = tl.load(norm_w_ptr + safe_features).to(tl.float32)[None, :]
            residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
        squares = pending_norm.add_loaded_residual_and_square(
            y, residual, out_ptr + offsets, norm_w, weighted_ptr + offsets, mask, 1
        )
        pending_norm.sum_group_squares(
            squares, rows, row_mask, tile_sums_ptr, out_sums_ptr, counters_ptr, GROUP_TILES
        )
    else:
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def in_groups_block(normed: PendingNorm | None, config: LinearConfig) -> int:
    """The tile of a normed input's slots a GEMV program loads (1 without a norm)."""
    if normed is None:
        return 1
    if config.block_m == 1:
        return normed.groups_block_for_row(config.num_warps)
    return normed.groups_block


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    normed: PendingNorm | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    prefetch_tiles: int = 0,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the GEMV, reading ``prefetch_tiles`` weight tiles before the PDL wait. A
    ``normed`` ``x`` is normed on the way in; with ``residual`` and ``norm_weight`` the results
    are ``round(x @ weight.T) + residual``, its rows' sums of squares (one slot per
    ``GROUP_TILES`` feature tiles) and that sum times ``norm_weight``. A plain projection
    writes into ``out`` when given."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if config.block_m > 1 and config.block_k % 8:
        raise ValueError(f"a GEMV of {config.block_m} rows needs a K tile of a multiple of 8")
    if out is not None and residual is not None:
        raise ValueError("the residual add writes outputs of its own")
    out = output_rows(out, num_rows, n, x)
    if num_rows == 0:
        return out, None, None
    grid = (cdiv(num_rows, config.block_m), cdiv(n, config.block_n))
    if grid[1] > MAX_FEATURE_TILES:
        raise ValueError(
            f"{n} output features in tiles of {config.block_n} make {grid[1]} programs, over "
            f"CUDA's {MAX_FEATURE_TILES} in a grid's second dimension: take a wider tile"
        )
    out_sums = tile_sums = counters = weighted = None
    group_tiles = group_tiles_now()
    if residual is not None:
        weighted = torch.empty_like(out)
        num_groups = cdiv(grid[1], group_tiles)
        out_sums = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
        tile_sums = torch.empty((num_rows, grid[1]), dtype=torch.float32, device=x.device)
        counters = split_counters(grid[0] * num_groups, x.device)
    with_pdl = use_pdl(x)
    rows, added = config.block_m > 1, residual is not None
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        out,
        norm_weight if norm_weight is not None else x,
        weighted if weighted is not None else x,
        normed.square_sums if normed is not None else x,
        residual if residual is not None else x,
        tile_sums if tile_sums is not None else x,
        out_sums if out_sums is not None else x,
        counters if counters is not None else x,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        normed.num_groups if normed is not None else 1,
        normed.eps if normed is not None else 0.0,
        HAS_BIAS=bias is not None,
        NORMED=normed is not None,
        IN_GROUPS=in_groups_block(normed, config),
        ADD_NORM=residual is not None,
        GROUP_TILES=group_tiles,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        PREFETCH_TILES=prefetch_tiles,
        LOOP_STAGES=config.num_stages,
        W_EVICT=weight_eviction(),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(
            with_pdl,
            "rows_gemv_add"
            if rows and added
            else "rows_gemv"
            if rows
            else "gemv_add"
            if added
            else "gemv",
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch_options(with_pdl),
    )
    return out, out_sums, weighted
