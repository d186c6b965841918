"""Gated activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import pdl
from kernels.backend import load_triton, next_power_of_2, triton_jit, use_pdl, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dimension."""
    half = x.shape[-1] // 2
    x32 = x.float()
    return (F.silu(x32[..., :half]) * x32[..., half:]).to(x.dtype)


# The row count is not specialized, for the reason given in kernels/rmsnorm.py.
@triton_jit(do_not_specialize=("num_rows",))
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    half,
    stride_x_row,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    # Grid (rows, column blocks): a [T, 2 * intermediate] input is read once, gate and up
    # halves side by side, and the product written once. Rows go on axis 0, the only axis
    # whose size is not capped at 65535.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * half + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError:
        x2 = x.contiguous().view(-1, x.shape[-1])
    num_rows = x2.shape[0]
    load_triton()
    block = min(1024, next_power_of_2(half))
    grid = (num_rows, -(-half // block))
    with_pdl = use_pdl(x)
    _silu_and_mul_kernel[grid](
        x2,
        out,
        num_rows,
        half,
        x2.stride(0),
        BLOCK=block,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "silu_and_mul"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
