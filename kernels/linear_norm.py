"""A projection ending in the residual add, with the RMSNorm after it left pending.

``linear_add_rms_norm(x, weight, residual, norm_weight, eps)`` is
``fused_add_rms_norm(x @ weight.T, residual, norm_weight, eps)``: it returns the normed
activation and the new residual stream. Where the Triton kernels run the projection (one
row: the GEMV; 2-64 rows: the skinny GEMM, where the table picks it) the add is the
projection's epilogue and the normed activation comes back as a ``PendingNorm``: the next
projection (``kernels.linear``, ``kernels.linear_silu_and_mul``) applies it as it loads its
input, so the add+RMSNorm kernel between the two is gone (kernels/pending_norm.py).
Elsewhere, and with ``PEGAINFER_NORM_FUSION=0``, the two steps run as before.

It fuses wherever the Triton kernels run the producer (1-32 rows of Qwen3-4B on an H200;
at 64 rows cuBLAS takes o and down). At 2-64 rows the producer lets the consumer launch only
as it ends (``kernels.pdl.launches_successor_early``). Launched early, its
programs resident beside the producer's running ones (the cause is inferred, not traced),
the fused pair lost to the norm kernel it replaces (decode steps 3.36 / 4.91 ms at 8 / 32 rows against
3.27 / 4.30 unfused; with PDL off 3.30 / 4.31). Launched late: 3.21 / 3.49 / 4.25 ms at 8 /
16 / 32 rows against 3.27 / 3.56 / 4.30 unfused (H200, Qwen3-4B, in process, two alternated
rounds). One row, the GEMV, fused first: 2.60 / 2.88 ms a step at context 128 / 4k against
2.63 / 2.90 unfused.

The reference is those two steps' references. With tensor-parallel row shards the add
must follow the all-reduce, so the layers use this only on one rank.
"""

from __future__ import annotations

import os

import torch

from kernels.linear import (
    LinearConfig,
    linear,
    linear_add_residual_triton,
    linear_ref,
    triton_eligible,
)
from kernels.linear_configs import pick_config
from kernels.pending_norm import PendingNorm
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref
from kernels.skinny_gemm import MAX_ROWS


def linear_add_rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x @ weight.T + residual), x @ weight.T + residual)``."""
    return fused_add_rms_norm_ref(linear_ref(x, weight), residual, norm_weight, eps)


def fused_rows_limit() -> int:
    """The most rows whose norm is left pending: ``PEGAINFER_NORM_FUSION`` 0 (never), 1
    (one row, the GEMV) or ``all`` (the default: up to 64, the skinny GEMM too)."""
    setting = os.environ.get("PEGAINFER_NORM_FUSION", "all").lower()
    if setting in ("0", "false", "off"):
        return 0
    return MAX_ROWS if setting == "all" else 1


def fusion_config(x: torch.Tensor, weight: torch.Tensor) -> LinearConfig | None:
    """The Triton tile that ends in the residual add for ``x [M, K]``, or None."""
    if x.dim() != 2 or not 0 < x.shape[0] <= fused_rows_limit():
        return None
    if not triton_eligible(x, weight):
        return None
    return pick_config(x.shape[0], *weight.shape)


def linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    prefetch: str | None = None,
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """``(normed, new residual)``; ``normed`` may be a ``PendingNorm`` (see above).
    ``prefetch``: see ``kernels.linear.linear_add_residual_triton``."""
    config = fusion_config(x, weight)
    if config is None or residual.dtype != x.dtype:
        return fused_add_rms_norm(linear(x, weight), residual, norm_weight, eps)
    stream, square_sums, weighted = linear_add_residual_triton(
        x, weight, residual, norm_weight, config, prefetch
    )
    return PendingNorm(stream, norm_weight, eps, square_sums, weighted), stream
