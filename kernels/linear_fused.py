"""The gate/up projection of one or two rows fused with the silu-and-mul that follows it.

Batch-1 decode is a chain of short kernels, and each boundary between two costs the GPU a
drain and a ramp even with programmatic dependent launch. ``linear_silu_and_mul`` writes
``silu(gate) * up`` straight from the gate/up GEMV: each program owns ``BLOCK_N`` output
features and reads their gate and up weight rows (``i`` and ``i + intermediate`` of the
fused ``[gate | up]`` weight) side by side in one K loop, so the epilogue has both halves. The projection is rounded to the activation dtype before the epilogue, as the
separate kernels see it. Two rows take the same loop with both rows in each program
(kernels/linear_fused_rows.py). At 3-64 rows the skinny GEMM does the same (kernels/skinny_gemm.py) where
``kernels/linear_configs.py`` picks it for the fused shape.
Other row counts (cuBLAS), CPU tensors and ``PEGAINFER_FUSED_GEMV=0`` run the two steps
separately; the reference is those two steps' references.

Measured against, and not used: the residual add and RMSNorm ending the o and down GEMVs,
done by the last of their 1,280 programs to count in at an arrival counter. On an H200
(``bench_latency --contexts 128,4096``, alternated with both fusions off) a batch-1 step
took 2.86 ms against 2.70 at context 128 and 3.13 against 2.97 at 4k: the 1,280 atomics on
one counter serialize, about 3-6 us a projection, more than the norm kernel they replace.
"""

from __future__ import annotations

import os

import torch

from kernels import gemv as gemv_tiles
from kernels import pdl, pending_norm
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.backend import cdiv, load_triton, triton_jit, use_pdl, weight_eviction
from kernels.linear import (
    LinearConfig,
    linear,
    linear_ref,
    triton_eligible,
    triton_handles,
)
from kernels.linear_fused_rows import linear_silu_and_mul_rows, rows_fusion_config
from kernels.pending_norm import PendingNorm
from kernels.skinny_gemm import MAX_ROWS, skinny_gemm_with

tl = None  # bound to triton.language by kernels.backend.load_triton()


def linear_silu_and_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up] = x @ weight.T``."""
    return silu_and_mul_ref(linear_ref(x, weight))


@triton_jit
def _row_dot_pair(
    x_ptr,
    gate_rows,
    up_rows,
    K,
    gate_acc,
    up_acc,
    FIRST_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    """``BLOCK_N`` float32 dot products of one activation row with the gate rows and with
    the up rows over the K tiles from ``FIRST_TILE`` on, both in one K loop, added to the
    accumulators' partial products; the caller rounds them to the activation dtype, as a
    stored projection output would be."""
    for k_start in tl.range(FIRST_TILE * BLOCK_K, K, BLOCK_K, num_stages=LOOP_STAGES):
        ks = k_start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            gate_w = tl.load(gate_rows + ks[None, :], eviction_policy=W_EVICT)
            up_w = tl.load(up_rows + ks[None, :], eviction_policy=W_EVICT)
            x = tl.load(x_ptr + ks)
        else:
            k_mask = ks < K
            gate_w = tl.load(
                gate_rows + ks[None, :], mask=k_mask[None, :], other=0.0, eviction_policy=W_EVICT
            )
            up_w = tl.load(
                up_rows + ks[None, :], mask=k_mask[None, :], other=0.0, eviction_policy=W_EVICT
            )
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
        x_row = x.to(tl.float32)[None, :]
        gate_acc += x_row * gate_w.to(tl.float32)
        up_acc += x_row * up_w.to(tl.float32)
    return tl.sum(gate_acc, axis=1), tl.sum(up_acc, axis=1)


@triton_jit
def _early_tile_products(x_ptr, gate_w, up_w, index, K, gate_acc, up_acc, BLOCK_K: tl.constexpr):
    """Adds one K tile's products of weight tiles read before the PDL wait."""
    ks = index * BLOCK_K + tl.arange(0, BLOCK_K)
    x_row = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
    return gate_acc + x_row * gate_w.to(tl.float32), up_acc + x_row * up_w.to(tl.float32)


@triton_jit
def _gemv_silu_and_mul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    in_sums_ptr,
    N,
    K,
    stride_w_row,
    num_in_groups,
    eps,
    NORMED: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREFETCH_TILES: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < N
    safe_features = tl.where(feature_mask, features, 0).to(tl.int64)
    gate_rows = w_ptr + safe_features[:, None] * stride_w_row
    up_rows = w_ptr + (safe_features + N)[:, None] * stride_w_row
    # Weights are written before the step: the first tiles may be read before the wait.
    if PREFETCH_TILES >= 1:
        gate_0 = gemv_tiles.weight_tile(gate_rows, 0, K, BLOCK_K, W_EVICT)
        up_0 = gemv_tiles.weight_tile(up_rows, 0, K, BLOCK_K, W_EVICT)
    if PREFETCH_TILES >= 2:
        gate_1 = gemv_tiles.weight_tile(gate_rows, 1, K, BLOCK_K, W_EVICT)
        up_1 = gemv_tiles.weight_tile(up_rows, 1, K, BLOCK_K, W_EVICT)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if NORMED:
        row = tl.arange(0, 1)
        square_sums = pending_norm.load_square_sums(
            in_sums_ptr, row, row < 1, num_in_groups, num_in_groups, IN_GROUPS
        )
    gate_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH_TILES >= 1:
        gate_acc, up_acc = _early_tile_products(
            x_ptr, gate_0, up_0, 0, K, gate_acc, up_acc, BLOCK_K
        )
    if PREFETCH_TILES >= 2:
        gate_acc, up_acc = _early_tile_products(
            x_ptr, gate_1, up_1, 1, K, gate_acc, up_acc, BLOCK_K
        )
    gate, up = _row_dot_pair(
        x_ptr,
        gate_rows,
        up_rows,
        K,
        gate_acc,
        up_acc,
        PREFETCH_TILES,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        LOOP_STAGES,
        W_EVICT,
    )
    if NORMED:
        inv_rms = tl.sum(pending_norm.inverse_rms(square_sums, K, eps))
        gate *= inv_rms
        up *= inv_rms
    out_type = out_ptr.dtype.element_ty
    gate = gate.to(out_type).to(tl.float32)
    up = up.to(out_type).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + features, (silu * up).to(out_ptr.dtype.element_ty), mask=feature_mask)


def _fused_tile(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) of the one-row GEMV for this shape."""
    from kernels.linear_configs import gemv_config

    config = gemv_config(n, k)
    return config.block_n, config.block_k, config.num_warps, config.num_stages


def fusion_enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x``'s one row runs the fused GEMV."""
    if os.environ.get("PEGAINFER_FUSED_GEMV", "1") in ("0", "false", "off"):
        return False
    return x.dim() == 2 and x.shape[0] == 1 and triton_handles(x, weight)


def skinny_fusion_config(x: torch.Tensor, weight: torch.Tensor) -> LinearConfig | None:
    """The skinny GEMM tile that fuses silu-and-mul for ``x``'s 2-64 rows, or None."""
    from kernels.linear_configs import skinny_config

    if os.environ.get("PEGAINFER_FUSED_GEMV", "1") in ("0", "false", "off"):
        return None
    if x.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS or not triton_eligible(x, weight):
        return None
    return skinny_config(x.shape[0], weight.shape[0], weight.shape[1], silu_mul=True)


def linear_silu_and_mul_triton(
    x: torch.Tensor | PendingNorm, weight: torch.Tensor, prefetch_tiles: int | None = None
) -> torch.Tensor:
    """The one-row fused kernel; ``prefetch_tiles`` weight tiles of each program are read
    before the PDL wait (None: ``gate_up_prefetch_tiles``'s rule)."""
    normed = x if isinstance(x, PendingNorm) else None
    if normed is not None:
        x = normed.weighted
    k = x.shape[-1]
    n = weight.shape[0] // 2
    if weight.shape[0] % 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} is no [gate | up] over {k} features")
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # Each program reads half as many weight rows as the plain GEMV's tile, a gate row and
    # its up row at each K step. On an H200 (Qwen3-4B, bench_latency, two alternated rounds)
    # a step took 2.55 ms against 2.56 with gate rows then up rows, at the plain tile's
    # width; two of each in one loop took 2.55-2.56 (64 registers against 38).
    block_n, block_k, num_warps, num_stages = _fused_tile(2 * n, k)
    block_n = max(1, block_n // 4)
    from kernels.linear_configs import fused_gate_up_block_n, gate_up_prefetch_tiles

    if prefetch_tiles is None:
        prefetch_tiles = gate_up_prefetch_tiles(k, block_k)
    block_n = fused_gate_up_block_n(block_n, 2 * n, k, prefetch_tiles > 0)
    load_triton()
    with_pdl = use_pdl(x)
    _gemv_silu_and_mul_kernel[(cdiv(n, block_n),)](
        x,
        weight,
        out,
        normed.square_sums if normed is not None else x,
        n,
        k,
        weight.stride(0),
        normed.num_groups if normed is not None else 1,
        normed.eps if normed is not None else 0.0,
        NORMED=normed is not None,
        IN_GROUPS=normed.groups_block_for_row(num_warps) if normed is not None else 1,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        PREFETCH_TILES=prefetch_tiles,
        LOOP_STAGES=num_stages,
        W_EVICT=weight_eviction(),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "gemv_silu"),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(with_pdl),
    )
    return out


def linear_silu_and_mul(x: torch.Tensor | PendingNorm, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; a ``PendingNorm`` ``x`` is applied inside the fused kernels."""
    stream = x.hidden if isinstance(x, PendingNorm) else x
    if fusion_enabled(stream, weight):
        return linear_silu_and_mul_triton(x, weight)
    rows_config = rows_fusion_config(stream, weight)
    if rows_config is not None:
        return linear_silu_and_mul_rows(x, weight, rows_config)
    config = skinny_fusion_config(stream, weight)
    if config is not None:
        if isinstance(x, PendingNorm):
            return skinny_gemm_with(x.weighted, weight, None, config, silu_mul=True, normed=x)
        return skinny_gemm_with(x, weight, None, config, silu_mul=True)
    return silu_and_mul(linear(x, weight))
