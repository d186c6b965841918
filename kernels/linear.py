"""Linear layers for few rows (decode): ``y = x @ weight.T (+ bias)``, bandwidth bound.

At decode batch sizes a linear layer reads the whole weight to produce a handful of rows,
so its speed is the weight's bytes over the memory bandwidth. Two Triton kernels cover it:

- ``_gemv_kernel`` (CUDA cores), for one or two rows: each program owns ``BLOCK_N`` output
  features of ``BLOCK_M`` rows, streams their weight rows in ``BLOCK_K`` chunks and keeps a
  float32 partial product per element, reduced once at the end. Small ``BLOCK_N`` gives
  thousands of programs, enough loads in flight to saturate HBM with no split over K. Its
  multiply-adds grow with the rows: from four rows they cost more than the tensor cores'.
- ``kernels/skinny_gemm.py`` (tensor cores), for 3-64 rows: weight tiles on the product's
  long side, a split over K merged by the last program of each tile.

``linear_ref`` is the reference (``torch.nn.functional.linear``); ``linear`` dispatches:
the kernel and tile ``kernels/linear_configs.py`` picks for a 16-bit CUDA tensor of that
shape and row count, cuBLAS where it picks none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import pdl, pending_norm, rows_tile
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, triton_jit, use_pdl, use_triton, weight_eviction
from kernels.pending_norm import PendingNorm, as_tensor
from kernels.skinny_gemm import MAX_ROWS, skinny_gemm_add_residual, skinny_gemm_with

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Feature tiles of a GEMV that share one slot of the sums of squares it hands to the next
# projection's norm: 1,280 tiles (Qwen3-4B's o and down) give 40 slots for it to read.
# ``PEGAINFER_NORM_GROUP_TILES=1`` gives every tile its own slot, with no arrival counters.
GROUP_TILES = 32


# What the kernel before a projection leaves of the memory bandwidth, which decides how much
# of its weight the projection reads before its PDL wait (kernels/linear_configs.py):
# decode attention leaves it mostly idle; a bandwidth-bound GEMV streams to its end.
AFTER_IDLE = "after_idle"
AFTER_STREAM = "after_stream"


# CUDA's limit on a grid's second dimension, which holds the GEMV's feature tiles.
MAX_FEATURE_TILES = 65_535


def group_tiles_now() -> int:
    return int(os.environ.get("PEGAINFER_NORM_GROUP_TILES", GROUP_TILES))


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape. ``kind`` is "gemv" (``block_m`` rows per program, any power of
    two; ``num_stages`` weight tiles its K loop keeps in flight through shared memory, 1 for
    none) or "skinny" (kernels/skinny_gemm.py: all rows, up to 64, in one tile; ``split_k``
    programs over K; ``paired``: the gate/up projection with silu-and-mul reads its gate and
    up rows in one K loop instead of one loop after the other)."""

    kind: str
    block_n: int
    block_k: int
    num_warps: int
    block_m: int = 1
    split_k: int = 1
    num_stages: int = 3
    paired: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("gemv", "skinny"):
            raise ValueError(f"unknown linear kernel {self.kind!r}")


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton_jit
def _weight_tile(rows, index, K, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
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
            w_0 = _weight_tile(w_rows, 0, K, BLOCK_K, W_EVICT)
        if PREFETCH_TILES >= 2:
            w_1 = _weight_tile(w_rows, 1, K, BLOCK_K, W_EVICT)
    else:
        w_rows = w_ptr + safe_features[None, :, None] * stride_w_row
        if PREFETCH_TILES >= 1:
            w_0 = rows_tile.tile_3d(w_rows, 0, K, BLOCK_K, EVEN_K, W_EVICT)
        if PREFETCH_TILES >= 2:
            w_1 = rows_tile.tile_3d(w_rows, BLOCK_K, K, BLOCK_K, EVEN_K, W_EVICT)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if NORMED:
        square_sums = pending_norm.load_square_sums(
            in_sums_ptr, rows, row_mask, num_in_groups, num_in_groups, IN_GROUPS
        )
    if BLOCK_M == 1:
        # The accumulator keeps the weight tile's own layout, so the loop has no layout
        # conversion. The [rows, features, K] form of a 2D tile converts both tiles through
        # shared memory every step (four barriers an iteration on sm_90); at one row it made a
        # Qwen3-4B decode step 2% slower on an H200 (2.61-2.62 against 2.57 ms).
        x_rows = x_ptr + safe_rows[:, None] * stride_x_row
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH_TILES >= 1:
            acc += _weight_tile(x_rows, 0, K, BLOCK_K, "").to(tl.float32) * w_0.to(tl.float32)
        if PREFETCH_TILES >= 2:
            acc += _weight_tile(x_rows, 1, K, BLOCK_K, "").to(tl.float32) * w_1.to(tl.float32)
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
    offsets = rows.to(tl.int64)[:, None] * stride_out_row + features[None, :]
    mask = row_mask[:, None] & feature_mask[None, :]
    if ADD_NORM:
        norm_w = tl.load(norm_w_ptr + safe_features).to(tl.float32)[None, :]
        squares = pending_norm.add_residual_and_square(
            y, residual_ptr + offsets, out_ptr + offsets, norm_w, weighted_ptr + offsets, mask, 1
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


def _gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: LinearConfig,
    normed: PendingNorm | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    prefetch_tiles: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the GEMV, reading ``prefetch_tiles`` weight tiles before the PDL wait. With
    ``normed``, ``x`` is its stream and the norm is applied on the way in; with ``residual`` and ``norm_weight``, the output is ``round(x @ weight.T) +
    residual``, the second result its rows' sums of squares, one slot per ``GROUP_TILES``
    feature tiles, and the third the output times ``norm_weight``."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if config.block_m > 1 and config.block_k % 8:
        raise ValueError(f"a GEMV of {config.block_m} rows needs a K tile of a multiple of 8")
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
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


def _checked(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {weight.shape[1]}")
    if weight.stride(-1) != 1:
        raise ValueError("the weight needs a unit last stride")
    return x if x.stride(-1) == 1 else x.contiguous()


def linear_triton(
    x: torch.Tensor | PendingNorm,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N]`` in ``x``'s dtype; a
    ``PendingNorm`` ``x`` [M, K] is normed on the way in."""
    from kernels.linear_configs import pick_config

    normed = x if isinstance(x, PendingNorm) else None
    if normed is not None:
        x = normed.weighted
    elif x.dim() != 2:
        lead = x.shape[:-1]
        return linear_triton(x.reshape(-1, x.shape[-1]), weight, bias, config).view(*lead, -1)
    x = _checked(x, weight)
    config = config or pick_config(x.shape[0], *weight.shape)
    if config is None:
        raise ValueError(f"no Triton linear kernel for {x.shape[0]} rows of {tuple(weight.shape)}")
    load_triton()
    if config.kind == "gemv":
        return _gemv(x, weight, bias, config, normed)[0]
    return skinny_gemm_with(x, weight, bias, config, normed=normed)


def linear_add_residual_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    config: LinearConfig,
    prefetch: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``s = round(x [M, K] @ weight.T) + residual [M, N]``, rounded; its rows' sums of
    squares ``[M, groups]`` float32; and ``s * norm_weight``: what the RMSNorm that follows
    needs (kernels/pending_norm.py). With ``prefetch`` (``AFTER_IDLE`` or ``AFTER_STREAM``:
    what the kernel before leaves of the memory bandwidth) the kernel reads its first weight
    tiles before waiting on the kernel before it (``prefetch_tiles``)."""
    x = _checked(x, weight)
    if tuple(residual.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} does not match the output")
    residual = residual.contiguous()
    load_triton()
    from kernels.linear_configs import prefetch_tiles

    tiles = prefetch_tiles(config, x.shape[1], prefetch) if prefetch else 0
    if config.kind == "gemv":
        out, sums, weighted = _gemv(x, weight, None, config, None, residual, norm_weight, tiles)
    else:
        out, sums, weighted = skinny_gemm_add_residual(
            x, weight, residual, norm_weight, config, tiles
        )
    assert sums is not None and weighted is not None
    return out, sums, weighted


def triton_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the Triton kernels can take ``x`` and ``weight``: 16-bit, alike, on CUDA."""
    return use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


def triton_handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when a Triton kernel is chosen for ``x`` (rows = all leading dims)."""
    from kernels.linear_configs import pick_config

    if not triton_eligible(x, weight):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= MAX_ROWS and pick_config(rows, *weight.shape) is not None


def linear(
    x: torch.Tensor | PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``; a ``PendingNorm`` is applied inside the Triton kernels and
    materialized first for cuBLAS."""
    if triton_handles(x.hidden if isinstance(x, PendingNorm) else x, weight):
        return linear_triton(x, weight, bias)
    return linear_ref(as_tensor(x), weight, bias)
