"""Linear layers for few rows (decode): ``y = x @ weight.T (+ bias)``, bandwidth bound.

At decode batch sizes a linear layer reads the whole weight to produce a handful of rows,
so its speed is the weight's bytes over the memory bandwidth. Two Triton kernels cover it:

- ``_gemv_kernel`` (CUDA cores): each program owns ``BLOCK_N`` output features of
  ``BLOCK_M`` rows, streams their weight rows in ``BLOCK_K`` chunks and keeps a float32
  partial product per element, reduced once at the end. Small ``BLOCK_N`` gives thousands
  of programs, enough loads in flight to saturate HBM with no split over K.
- ``_skinny_gemm_kernel`` (``tl.dot`` on ``BLOCK_M`` rows padded to at least 16): several
  rows share each weight tile; an optional split over K (float32 atomics) fills the GPU
  when there are few output tiles.

``linear_ref`` is the reference (``torch.nn.functional.linear``); ``linear`` dispatches:
Triton for up to ``MAX_TRITON_ROWS`` rows of a 16-bit CUDA tensor, cuBLAS otherwise. Which
kernel and tile run for a given (rows, N, K) comes from ``kernels/linear_configs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import pdl
from kernels.backend import (
    cdiv,
    dot_needs_fp32,
    load_triton,
    triton_jit,
    use_pdl,
    use_triton,
)

tl = None  # bound to triton.language by kernels.backend.load_triton()


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape. ``kind`` is "gemv" (``block_m`` rows per program, any power of
    two) or "dot" (``block_m`` at least 16, for ``tl.dot``); ``split_k`` applies to "dot"
    only."""

    kind: str
    block_n: int
    block_k: int
    num_warps: int
    block_m: int = 1
    split_k: int = 1
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.kind == "dot" and self.block_m < 16:
            raise ValueError(f"a dot tile needs at least 16 rows, got {self.block_m}")


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton_jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
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
    w_rows = w_ptr + safe_features[:, None] * stride_w_row
    pdl.wait_for_inputs(USE_PDL)
    x_rows = x_ptr + safe_rows[:, None] * stride_x_row
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
            x = tl.load(x_rows + ks[None, :])
        else:
            k_mask = ks < K
            w = tl.load(w_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(bias_ptr + safe_features).to(tl.float32)[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride_out_row + features[None, :]
    tl.store(
        out_ptr + offsets,
        y.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & feature_mask[None, :],
    )


@triton_jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    tile_m = tl.program_id(2)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    features = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    feature_mask = features < N
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    safe_features = tl.where(feature_mask, features, 0).to(tl.int64)
    x_rows = x_ptr + safe_rows[:, None] * stride_x_row
    w_rows = w_ptr + safe_features[:, None] * stride_w_row
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(k_begin, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :])
            w = tl.load(w_rows + ks[None, :])
        else:
            k_mask = ks < k_end
            x = tl.load(x_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        # Added by the first split only, so that the atomic sum counts it once.
        bias = tl.load(bias_ptr + safe_features).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride_out_row + features[None, :]
    mask = row_mask[:, None] & feature_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptr + offsets, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N]`` in ``x``'s dtype."""
    from kernels.linear_configs import pick_config

    if x.dim() != 2:
        lead = x.shape[:-1]
        return linear_triton(x.reshape(-1, x.shape[-1]), weight, bias, config).view(*lead, -1)
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight expects {weight.shape[1]}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("the weight needs a unit last stride")
    config = config or pick_config(num_rows, n, k)
    load_triton()
    has_bias = bias is not None
    if config.kind == "gemv":
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
        if num_rows == 0:
            return out
        grid = (cdiv(num_rows, config.block_m), cdiv(n, config.block_n))
        with_pdl = use_pdl(x)
        _gemv_kernel[grid](
            x,
            weight,
            bias if has_bias else x,
            out,
            num_rows,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            out.stride(0),
            HAS_BIAS=has_bias,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            EVEN_K=k % config.block_k == 0,
            USE_PDL=with_pdl,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **pdl.launch_options(with_pdl),
        )
        return out
    split_k = max(1, min(config.split_k, cdiv(k, config.block_k)))
    k_per_split = cdiv(cdiv(k, split_k), config.block_k) * config.block_k
    split_k = cdiv(k, k_per_split)
    atomic = split_k > 1
    if atomic:
        out = torch.zeros((num_rows, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out.to(x.dtype)
    grid = (cdiv(n, config.block_n), split_k, cdiv(num_rows, config.block_m))
    _skinny_gemm_kernel[grid](
        x,
        weight,
        bias if has_bias else x,
        out,
        num_rows,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=has_bias,
        ATOMIC=atomic,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k_per_split % config.block_k == 0 and k % k_per_split == 0,
        DOT_FP32=dot_needs_fp32(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out.to(x.dtype) if atomic else out


def triton_handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the Triton path is chosen for ``x`` (rows = all leading dims)."""
    from kernels.linear_configs import MAX_TRITON_ROWS

    if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if weight.dtype != x.dtype:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= MAX_TRITON_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if triton_handles(x, weight):
        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)
