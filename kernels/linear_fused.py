"""One-row linear layers fused with the kernel that follows them in a decoder layer.

Batch-1 decode is a chain of short kernels, and each boundary between two costs the GPU a
drain and a ramp even with programmatic dependent launch. Two of every layer's small
kernels fold into the GEMV before them:

- ``linear_silu_and_mul``: the gate/up projection writes ``silu(gate) * up`` directly. Each
  program owns ``BLOCK_N`` output features and reads their gate and up weight rows (``i``
  and ``i + intermediate`` of the fused ``[gate | up]`` weight), so the epilogue has both.
- ``linear_add_rms_norm``: the o and down projections end with the residual add and the
  RMSNorm that follows them. The norm needs the whole output row, so every program stores
  its features and counts in at an arrival counter; the last one to arrive adds the
  residual and norms the row (a 2,560-wide row is one program's work).

Both round the projection's output to the activation dtype before the epilogue, exactly as
the separate kernels see it, so fused and unfused results agree to the reduction order.
Other row counts (cuBLAS), CPU tensors and ``PEGAINFER_FUSED_GEMV=0`` run the two steps
separately; the references are those two steps' references.
"""

from __future__ import annotations

import os

import torch

from kernels import attention_merge, pdl
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl
from kernels.linear import linear, linear_ref, triton_handles
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref

tl = None  # bound to triton.language by kernels.backend.load_triton()


def linear_silu_and_mul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up] = x @ weight.T``."""
    return silu_and_mul_ref(linear_ref(x, weight))


def linear_add_rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x @ weight.T + residual), x @ weight.T + residual)``."""
    return fused_add_rms_norm_ref(linear_ref(x, weight), residual, norm_weight, eps)


@triton_jit
def _row_dot(x_ptr, w_rows, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``BLOCK_N`` dot products of one activation row with the weight rows at ``w_rows``,
    rounded to the activation dtype as a stored projection output would be."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
            x = tl.load(x_ptr + ks)
        else:
            k_mask = ks < K
            w = tl.load(w_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
        acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    return tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton_jit
def _gemv_silu_and_mul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_w_row,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < N
    safe_features = tl.where(feature_mask, features, 0).to(tl.int64)
    gate_rows = w_ptr + safe_features[:, None] * stride_w_row
    up_rows = w_ptr + (safe_features + N)[:, None] * stride_w_row
    pdl.wait_for_inputs(USE_PDL)
    gate = _row_dot(x_ptr, gate_rows, K, BLOCK_N, BLOCK_K, EVEN_K)
    up = _row_dot(x_ptr, up_rows, K, BLOCK_N, BLOCK_K, EVEN_K)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + features, (silu * up).to(out_ptr.dtype.element_ty), mask=feature_mask)


@triton_jit
def _gemv_add_rms_norm_kernel(
    x_ptr,
    w_ptr,
    projected_ptr,
    residual_ptr,
    residual_out_ptr,
    out_ptr,
    norm_weight_ptr,
    counter_ptr,
    N,
    K,
    stride_w_row,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_mask = features < N
    safe_features = tl.where(feature_mask, features, 0).to(tl.int64)
    w_rows = w_ptr + safe_features[:, None] * stride_w_row
    pdl.wait_for_inputs(USE_PDL)
    projected = _row_dot(x_ptr, w_rows, K, BLOCK_N, BLOCK_K, EVEN_K)
    tl.store(
        projected_ptr + features, projected.to(projected_ptr.dtype.element_ty), mask=feature_mask
    )
    if attention_merge.arrive_last(counter_ptr, tl.num_programs(0)):
        cols = tl.arange(0, ROW_BLOCK)
        col_mask = cols < N
        # .cg: the other programs' stores are read from L2, never from a stale L1 line.
        row = tl.load(projected_ptr + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
        residual = tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        summed = (row.to(tl.float32) + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + cols, summed, mask=col_mask)
        summed32 = summed.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(summed32 * summed32, axis=0) / N + eps)
        norm_weight = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        normed = summed32 * inv_rms * norm_weight
        tl.store(out_ptr + cols, normed.to(out_ptr.dtype.element_ty), mask=col_mask)
        tl.store(counter_ptr, 0)  # ready for the next launch (or graph replay)


def _fused_tile(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) of the one-row GEMV for this shape."""
    from kernels.linear_configs import pick_config

    config = pick_config(1, n, k)
    return config.block_n, config.block_k, config.num_warps, config.num_stages


def fusion_enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x``'s one row runs the fused GEMV."""
    if os.environ.get("PEGAINFER_FUSED_GEMV", "1") in ("0", "false", "off"):
        return False
    return x.dim() == 2 and x.shape[0] == 1 and triton_handles(x, weight)


def linear_silu_and_mul_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    n = weight.shape[0] // 2
    if weight.shape[0] % 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} is no [gate | up] over {k} features")
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # Each program reads as many weight rows as the plain GEMV's tile: half gate, half up.
    block_n, block_k, num_warps, num_stages = _fused_tile(2 * n, k)
    block_n = max(1, block_n // 2)
    load_triton()
    with_pdl = use_pdl(x)
    _gemv_silu_and_mul_kernel[(cdiv(n, block_n),)](
        x,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        USE_PDL=with_pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(with_pdl),
    )
    return out


def linear_add_rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {k} features")
    if tuple(residual.shape) != (1, n):
        raise ValueError(f"residual {tuple(residual.shape)} is not one row of {n}")
    x = x.contiguous()
    residual = residual.contiguous()
    projected = torch.empty((1, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(projected)
    out = torch.empty_like(projected)
    block_n, block_k, num_warps, num_stages = _fused_tile(n, k)
    load_triton()
    with_pdl = use_pdl(x)
    _gemv_add_rms_norm_kernel[(cdiv(n, block_n),)](
        x,
        weight,
        projected,
        residual,
        residual_out,
        out,
        norm_weight,
        split_counters(1, x.device),
        n,
        k,
        weight.stride(0),
        eps,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        ROW_BLOCK=next_power_of_2(n),
        USE_PDL=with_pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(with_pdl),
    )
    return out, residual_out


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if fusion_enabled(x, weight):
        return linear_silu_and_mul_triton(x, weight)
    return silu_and_mul(linear(x, weight))


def linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if fusion_enabled(x, weight):
        return linear_add_rms_norm_triton(x, weight, residual, norm_weight, eps)
    return fused_add_rms_norm(linear(x, weight), residual, norm_weight, eps)
