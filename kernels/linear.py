"""Linear layers for few rows (decode): ``y = x @ weight.T (+ bias)``, bandwidth bound.

At decode batch sizes a linear layer reads the whole weight to produce a handful of rows,
so its speed is the weight's bytes over the memory bandwidth. Two Triton kernels cover it:

- ``_gemv_kernel`` (CUDA cores), for one row: each program owns ``BLOCK_N`` output features
  of ``BLOCK_M`` rows, streams their weight rows in ``BLOCK_K`` chunks and keeps a float32
  partial product per element, reduced once at the end. Small ``BLOCK_N`` gives thousands
  of programs, enough loads in flight to saturate HBM with no split over K.
- ``kernels/skinny_gemm.py`` (tensor cores), for 2-64 rows: weight tiles on the product's
  long side, a split over K merged by the last program of each tile.

``linear_ref`` is the reference (``torch.nn.functional.linear``); ``linear`` dispatches:
the kernel and tile ``kernels/linear_configs.py`` picks for a 16-bit CUDA tensor of that
shape and row count, cuBLAS where it picks none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import pdl
from kernels.backend import cdiv, load_triton, triton_jit, use_pdl, use_triton
from kernels.skinny_gemm import MAX_ROWS, skinny_gemm_with

tl = None  # bound to triton.language by kernels.backend.load_triton()


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape. ``kind`` is "gemv" (``block_m`` rows per program, any power of
    two) or "skinny" (kernels/skinny_gemm.py: all rows, up to 64, in one tile; ``split_k``
    programs over K)."""

    kind: str
    block_n: int
    block_k: int
    num_warps: int
    block_m: int = 1
    split_k: int = 1
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.kind not in ("gemv", "skinny"):
            raise ValueError(f"unknown linear kernel {self.kind!r}")


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
    if config is None:
        raise ValueError(f"no Triton linear kernel for {num_rows} rows of {n}x{k}")
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
    return skinny_gemm_with(x, weight, bias, config)


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if triton_handles(x, weight):
        return linear_triton(x, weight, bias)
    return linear_ref(x, weight, bias)
