"""The experts' grouped GEMM tiles (kernels/fused_moe.py): the tile for a token count, the
shared memory it takes, and whether the down GEMM reads ahead of its PDL wait."""

from __future__ import annotations

import functools
import os

# Shared memory of an sm_90 SM a program may take (H100 and H200).
SHARED_MEMORY_BYTES = 232448


def moe_tiles(num_tokens: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """(block_m, block_n, block_k, warps): at decode sizes the smallest row block a dot
    takes and long K tiles, wider row blocks as they fill. Qwen3-30B-A3B's whole sparse MLP
    at 1 / 8 / 32 tokens on an H100, as graph replays: 40.3 / 151.8 / 360.8 us with (16, 64,
    256, 4) against 44.2 / 165.2 / 389.5 with (16, 64, 64, 4), the experts' bytes taking
    25.1 / 138.2 / 348.6 at the copy bandwidth (tools/MEASUREMENTS.md). A K tile too long for
    shared memory (the decode tile in float32: 288 KB) is halved until it fits."""
    if num_tokens <= 32:
        block_m, block_n, block_k, warps = 16, 64, 256, 4
    elif num_tokens <= 256:
        block_m, block_n, block_k, warps = 32, 64, 128, 4
    else:
        block_m, block_n, block_k, warps = 64, 128, 64, 8
    while tile_shared_bytes((block_m, block_n, block_k, warps), element_size) > (
        SHARED_MEMORY_BYTES
    ):
        block_k //= 2
    return block_m, block_n, block_k, warps


def tile_shared_bytes(tiles: tuple[int, int, int, int], element_size: int) -> int:
    """Shared memory of the gated GEMM's pipelined loads: Triton buffers ``num_stages - 1``
    (two) stages of an activation tile and two weight tiles."""
    block_m, block_n, block_k, _ = tiles
    return 2 * (block_m + 2 * block_n) * block_k * element_size


# Whether the down GEMM reads its layout and first weight tile before its PDL wait. On
# H100s it took 1.0-1.6% off Qwen3-30B-A3B's batch-1 step (about 1 us a layer) and changed
# nothing at 2-8 rows beyond 0.4%. ``PEGAINFER_MOE_DOWN_EARLY_TILE`` (0 or 1) replaces it.
DOWN_EARLY_TILE = True


@functools.cache
def down_early_tile() -> bool:
    """``DOWN_EARLY_TILE``, or ``PEGAINFER_MOE_DOWN_EARLY_TILE`` where set (read once)."""
    setting = os.environ.get("PEGAINFER_MOE_DOWN_EARLY_TILE", str(int(DOWN_EARLY_TILE)))
    if setting not in ("0", "1"):
        raise ValueError(f"PEGAINFER_MOE_DOWN_EARLY_TILE must be 0 or 1, got {setting!r}")
    return setting == "1"
