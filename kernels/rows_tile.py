"""The K step of a GEMV that keeps several rows in each program (kernels/gemv.py,
kernels/linear_fused_rows.py).

The weight tile ``[1, features, K]`` and the activation tile ``[rows, 1, K]`` are loaded as
3D tensors, so both take the layout of their broadcast product: threads and warps along K,
rows and features in each thread's registers. Written as ``x[:, None, :] * w[None, :, :]``
from 2D tiles instead, Triton converts both tiles through shared memory at every step (on
sm_90: barriers in the loop, seen in the compiled code).
"""

from __future__ import annotations

from kernels.backend import triton_jit

tl = None  # bound to triton.language by kernels.backend.load_triton()


@triton_jit
def tile_3d(base, k_start, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """The ``[rows or 1, features or 1, BLOCK_K]`` tile at ``k_start`` of ``base``, a
    ``[rows or 1, features or 1, 1]`` tensor of row pointers."""
    ks = k_start + tl.arange(0, BLOCK_K)[None, None, :]
    if EVEN_K:
        tile = tl.load(base + ks, eviction_policy=EVICT)
    else:
        tile = tl.load(base + ks, mask=ks < K, other=0.0, eviction_policy=EVICT)
    return tile


@triton_jit
def rows_products(x, w, acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N, BLOCK_K // 8]`` plus the products of one K step's float32
    tiles ``x [BLOCK_M, 1, BLOCK_K]`` and ``w [1, BLOCK_N, BLOCK_K]``. Each thread holds 8
    consecutive K of a tile (one 16-byte load), so summing them is a reduction inside the
    thread, and the accumulator stays 8 times smaller than the tile."""
    products = tl.reshape(x * w, [BLOCK_M, BLOCK_N, BLOCK_K // 8, 8])
    return acc + tl.sum(products, axis=3)


@triton_jit
def rows_step(
    x_rows,
    w,
    k_start,
    K,
    acc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``rows_products`` of the K step at ``k_start``, its weight tile ``w`` loaded."""
    x = tile_3d(x_rows, k_start, K, BLOCK_K, EVEN_K, "").to(tl.float32)
    return rows_products(x, w.to(tl.float32), acc, BLOCK_M, BLOCK_N, BLOCK_K)
