"""Linear layers for few rows (decode): ``y = x @ weight.T (+ bias)``, bandwidth bound.

At decode batch sizes a linear layer reads the whole weight to produce a handful of rows,
so its speed is the weight's bytes over the memory bandwidth. Two Triton kernels cover it:

- ``kernels/gemv.py`` (CUDA cores), for one or two rows: thousands of programs of a few
  output features each, enough loads in flight to saturate HBM with no split over K.
- ``kernels/skinny_gemm.py`` (tensor cores), for 3-64 rows: weight tiles on the product's
  long side, a split over K merged by the last program of each tile.

``linear_ref`` is the reference (``torch.nn.functional.linear``); ``linear`` dispatches:
the kernel and tile ``kernels/linear_configs.py`` picks for a 16-bit CUDA tensor of that
shape and row count, cuBLAS where it picks none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import load_triton, output_rows, use_triton
from kernels.gemv import gemv
from kernels.pending_norm import PendingNorm, as_tensor
from kernels.skinny_gemm import MAX_ROWS, skinny_gemm_add_residual, skinny_gemm_with

# What the kernel before a projection leaves of the memory bandwidth, which decides how much
# of its weight the projection reads before its PDL wait (kernels/linear_configs.py):
# decode attention leaves it mostly idle; a bandwidth-bound GEMV streams to its end.
AFTER_IDLE = "after_idle"
AFTER_STREAM = "after_stream"


@dataclass(frozen=True)
class LinearConfig:
    """One launch shape. ``kind`` is "gemv" (``block_m`` rows per program, any power of
    two; ``num_stages`` weight tiles its K loop keeps in flight through shared memory, 1 for
    none) or "skinny" (kernels/skinny_gemm.py: all rows, up to 64, in one tile; ``split_k``
    programs over K; ``paired``: the gate/up projection with silu-and-mul reads its gate and
    up rows in one K loop instead of one loop after the other; ``groups`` > 0: the features
    are divided evenly over that many programs per split, each within a ``block_n`` tile,
    instead of in whole tiles, so that a grid of one program per SM carries equal work)."""

    kind: str
    block_n: int
    block_k: int
    num_warps: int
    block_m: int = 1
    split_k: int = 1
    num_stages: int = 3
    paired: bool = False
    groups: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("gemv", "skinny"):
            raise ValueError(f"unknown linear kernel {self.kind!r}")


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    result = F.linear(x, weight, bias)
    if out is None:
        return result
    # A copy, not matmul's ``out=``: the product stays the very call F.linear makes.
    return output_rows(out, x.shape[0], weight.shape[0], x).copy_(result)


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
    out: torch.Tensor | None = None,
    prefetch: str | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N]`` in ``x``'s dtype, written into
    ``out`` when given (2D ``x`` only); a ``PendingNorm`` ``x`` [M, K] is normed on the way
    in. ``prefetch``: as in ``linear_add_residual_triton``, for the one-row GEMV only."""
    from kernels.linear_configs import pick_config

    normed = x if isinstance(x, PendingNorm) else None
    if normed is not None:
        x = normed.weighted
    elif x.dim() != 2:
        if out is not None:
            raise ValueError("out takes a 2D x")
        lead = x.shape[:-1]
        return linear_triton(x.reshape(-1, x.shape[-1]), weight, bias, config).view(*lead, -1)
    x = _checked(x, weight)
    picked = config is None
    config = config or pick_config(x.shape[0], *weight.shape)
    if config is None:
        raise ValueError(f"no Triton linear kernel for {x.shape[0]} rows of {tuple(weight.shape)}")
    load_triton()
    if config.kind == "gemv":
        tiles = 0
        if prefetch and config.block_m == 1:
            from kernels.linear_configs import prefetch_tiles, prefetching_gemv_config

            if picked:
                config = prefetching_gemv_config(config, *weight.shape)
            tiles = prefetch_tiles(config, x.shape[1], prefetch)
        return gemv(x, weight, bias, config, normed, prefetch_tiles=tiles, out=out)[0]
    return skinny_gemm_with(x, weight, bias, config, normed=normed, out=out)


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
        out, sums, weighted = gemv(x, weight, None, config, None, residual, norm_weight, tiles)
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
    x: torch.Tensor | PendingNorm,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    prefetch: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, written into ``out [M, N]`` when given (2D ``x``); a
    ``PendingNorm`` is applied inside the Triton kernels and materialized first for cuBLAS.
    ``prefetch``: see ``linear_triton``."""
    if triton_handles(x.hidden if isinstance(x, PendingNorm) else x, weight):
        return linear_triton(x, weight, bias, out=out, prefetch=prefetch)
    return linear_ref(as_tensor(x), weight, bias, out)
