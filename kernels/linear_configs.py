"""Which Triton linear kernel and tile run for ``rows x K @ K x N`` (see kernels/linear.py).

The choices come from ``python -m tools.tune_linear`` on an H200 (bf16), which times every
candidate inside a CUDA graph with the weights cycled so that none is served from L2. Shapes
it did not time take the nearest measured rule below. The one-row GEMV beats cuBLAS on every
Qwen3-4B projection (by 8-26%); from two rows up the tensor-core kernel only ties it, or
loses, so ``kernels.linear`` hands everything past ``MAX_TRITON_ROWS`` rows to cuBLAS. The
"dot" rules stay for ``tools/tune_linear.py`` to keep measuring that choice.

``PEGAINFER_LINEAR_TILES`` replaces the one-row GEMV tile of given shapes, so that a tile
``tune_linear`` found can be tried in a whole decode step before it becomes a rule here:
``"N,K=block_n,block_k,num_warps[,num_stages];..."``, e.g. ``"2560,4096=4,2048,8"``.
"""

from __future__ import annotations

import functools
import os

from kernels.backend import cdiv
from kernels.linear import LinearConfig

MAX_TRITON_ROWS = 1

# Output features from which a projection counts as wide (qkv, gate_up, lm_head at 4B) rather
# than narrow (o, down: N = hidden), for which a split over K is needed to fill the GPU.
_WIDE_N = 4096
# Programs a narrow projection is split over K to reach: about two per SM on a 132-SM part.
_TARGET_PROGRAMS = 264


@functools.cache
def gemv_tile_overrides(spec: str) -> dict[tuple[int, int], LinearConfig]:
    """Parse a ``PEGAINFER_LINEAR_TILES`` value (see the module docstring)."""
    overrides: dict[tuple[int, int], LinearConfig] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        try:
            shape, tile = entry.split("=")
            n, k = (int(v) for v in shape.split(","))
            block_n, block_k, warps, *stages = (int(v) for v in tile.split(","))
            if len(stages) > 1:
                raise ValueError("too many fields")
        except ValueError as exc:
            raise ValueError(
                f"PEGAINFER_LINEAR_TILES entry {entry!r}: want N,K=block_n,block_k,num_warps"
                f"[,num_stages] ({exc})"
            ) from None
        overrides[(n, k)] = LinearConfig(
            "gemv", block_n, block_k, warps, num_stages=stages[0] if stages else 3
        )
    return overrides


def pick_config(num_rows: int, n: int, k: int) -> LinearConfig:
    if num_rows == 1:
        override = gemv_tile_overrides(os.environ.get("PEGAINFER_LINEAR_TILES", "")).get((n, k))
        if override is not None:
            return override
    if num_rows <= 2:
        if num_rows == 1:
            block_k = 1024 if k >= 4096 else 512
            block_n = 2 if block_k == 1024 else 4
        else:
            block_k, block_n = 512, 4
        warps = 4 if block_k >= 1024 else 2
        return LinearConfig("gemv", block_n, block_k, warps)
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    wide = n >= _WIDE_N
    block_n = 64 if wide or block_m == 16 else 32
    stages = 5 if wide and block_m != 32 else 3
    tiles = cdiv(n, block_n) * cdiv(num_rows, block_m)
    split_k = 1
    while not wide and tiles * split_k < _TARGET_PROGRAMS and cdiv(k, 128) >= split_k * 8:
        split_k *= 2
    return LinearConfig(
        "dot",
        block_n=block_n,
        block_k=128,
        num_warps=4,
        block_m=block_m,
        split_k=split_k,
        num_stages=stages,
    )
