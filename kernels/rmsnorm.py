"""RMSNorm, plain, fused with the residual add that precedes it in every decoder layer, and
fused with the token embedding lookup that precedes the first layer's.

All compute in float32 and cast the result back to the input's dtype, so bfloat16 models
lose no precision in the reduction. ``embed_rms_norm`` gathers each token's row of the
embedding table in the norm kernel itself: the rows and their norm are the same bits as
the lookup followed by ``rms_norm`` (the same kernel body), one launch fewer a step.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.backend import load_triton, next_power_of_2, triton_jit, use_pdl, use_triton
from kernels.embedding import embedding_ref

tl = None  # bound to triton.language by kernels.backend.load_triton()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def embed_rms_norm_ref(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(rows), rows)`` for ``rows = table[ids]``; an id outside the table gives a
    row of zeros (as kernels/embedding.py)."""
    rows = embedding_ref(ids, table)
    return rms_norm_ref(rows, weight, eps), rows


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``.

    The new residual is rounded to the input dtype once, and the norm is taken of that
    rounded sum, so the value the next layer adds back is exactly the one that was normed.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


# A step's row count is not specialized: an eager prefill of a token count that is not a
# multiple of 16 otherwise compiled a variant of its own inside that step (150-170 ms on an
# H200, named by kernels/compile_watch.py).
@triton_jit(do_not_specialize=("num_rows",))
def _rms_norm_kernel(
    x_ptr,
    ids_ptr,
    residual_ptr,
    residual_out_ptr,
    out_ptr,
    weight_ptr,
    num_rows,
    inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    hidden,
    eps,
    num_table_rows,
    HAS_RESIDUAL: tl.constexpr,
    GATHER: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    # Rows are addressed as (outer, inner) so a [T, heads, head_dim] view with a token
    # stride wider than heads * head_dim (a slice of the fused qkv) needs no copy.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < hidden
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    outer = (rows // inner).to(tl.int64)
    inner_idx = (rows % inner).to(tl.int64)
    load_mask = mask
    if GATHER:
        # x is the embedding table and row r is token ids[r]'s; an id outside it reads zeros.
        outer = tl.load(ids_ptr + rows, mask=rows < num_rows, other=0).to(tl.int64)
        in_table = (outer >= 0) & (outer < num_table_rows)
        outer = tl.where(in_table, outer, 0)
        load_mask = mask & in_table[:, None]
    x_offsets = (outer * stride_x_outer + inner_idx * stride_x_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=load_mask, other=0.0).to(tl.float32)
    out_offsets = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
    if GATHER:
        tl.store(residual_out_ptr + out_offsets, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    if HAS_RESIDUAL:
        r_offsets = (outer * stride_r_outer + inner_idx * stride_r_inner)[:, None] + cols[None, :]
        residual = tl.load(residual_ptr + r_offsets, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the storage dtype first, and norm exactly what is handed on.
        summed = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_offsets, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=1) / hidden
    inv_rms = 1.0 / tl.sqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = x * inv_rms[:, None] * weight[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """View ``x`` as ``[outer, inner, hidden]`` with a unit last stride; returns
    ``(x3, inner, stride_outer, stride_inner)``, copying only if no such view exists."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        x3 = x.view(1, 1, -1)
    elif x.dim() == 2:
        x3 = x.unsqueeze(1)
    else:
        try:
            x3 = x.view(-1, x.shape[-2], x.shape[-1])
        except RuntimeError:
            x3 = x.contiguous().view(-1, x.shape[-2], x.shape[-1])
    return x3, x3.shape[1], x3.stride(0), x3.stride(1)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The norm of ``x``'s rows (with ``residual`` added first), or with ``ids`` of the rows
    of the table ``x`` they name; returns ``(out, the rows normed)`` for either."""
    load_triton()
    hidden = x.shape[-1]
    if ids is None:
        x3, inner, sx_outer, sx_inner = _as_rows(x)
        num_rows, shape = x3.shape[0] * inner, x.shape
    else:
        if x.dim() != 2 or x.stride(-1) != 1:
            raise ValueError("the embedding table needs to be [rows, hidden], unit last stride")
        x3, inner, sx_outer, sx_inner = x, 1, x.stride(0), 0
        num_rows, shape = ids.numel(), (*ids.shape, hidden)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    residual_out = None
    r3, sr_outer, sr_inner = x3, sx_outer, sx_inner
    if residual is not None:
        r3, _, sr_outer, sr_inner = _as_rows(residual)
    if residual is not None or ids is not None:
        residual_out = torch.empty(shape, dtype=x.dtype, device=x.device)
    block = next_power_of_2(hidden)
    # Small rows (per-head q/k norms, head_dim 128) are packed several to a program so
    # each program still moves a few KB.
    rows_per_program = max(1, min(16, 2048 // block))
    num_warps = 4 if block <= 2048 else 8
    grid = (-(-num_rows // rows_per_program),)
    with_pdl = use_pdl(x)
    _rms_norm_kernel[grid](
        x3,
        ids.reshape(-1) if ids is not None else x3,
        r3,
        residual_out if residual_out is not None else out,
        out,
        weight,
        num_rows,
        inner,
        sx_outer,
        sx_inner,
        sr_outer,
        sr_inner,
        hidden,
        eps,
        # The table's rows; 0 otherwise, where x.shape[0] would be a step's row count,
        # which must not make a new variant (see num_rows above).
        x.shape[0] if ids is not None else 0,
        HAS_RESIDUAL=residual is not None,
        GATHER=ids is not None,
        ROWS=rows_per_program,
        BLOCK=block,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "rmsnorm"),
        num_warps=num_warps,
        **pdl.launch_options(with_pdl),
    )
    return out, residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.numel() == 0:
        return torch.empty_like(x)
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if x.numel() == 0:
        return torch.empty_like(x), torch.empty_like(x)
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def embed_rms_norm_triton(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if ids.numel() == 0:
        empty = torch.empty((*ids.shape, table.shape[1]), dtype=table.dtype, device=table.device)
        return empty, empty.clone()
    out, rows = _launch(table, None, weight, eps, ids=ids)
    assert rows is not None
    return out, rows


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(table[ids]), table[ids])``: the embedding lookup and the norm after it in
    one launch (see the module docstring)."""
    if use_triton(table):
        return embed_rms_norm_triton(ids, table, weight, eps)
    return embed_rms_norm_ref(ids, table, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)
