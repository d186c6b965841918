"""How split decode attention (kernels/decode_attention.py) divides a batch's keys: the
grid's splits per sequence, the shortest split, the merge's tile, and the settings that
replace the rules to try another choice in whole steps. Host integers only: the grid of a
captured CUDA graph depends on nothing else."""

from __future__ import annotations

import functools
import os

import torch

from kernels.backend import cdiv, next_power_of_2, num_sms

# A split covers at least this many tokens. Short splits keep a program's chain of
# dependent K/V loads short, and the merge inside the kernel costs little: on an H200 (Qwen3-4B
# heads, one sequence) 64 against 256 took 1k-token decode from 9.6 to 7.2 us a layer, and
# whole batch-1 steps from 2.49 / 2.63 / 2.72 to 2.40 / 2.48 / 2.68 ms at context 128 / 1k /
# 4k (alternated; one split up to 256 tokens is slower than two merged).
# ``PEGAINFER_DECODE_MIN_SPLIT`` replaces it.
MIN_SPLIT_TOKENS = 64
# The most splits a sequence takes; only one sequence at a long context reaches it. On an
# H200 (Qwen3-4B, batch 1, bench_latency, alternated) 48 against 32 took a decode step from
# 3.15 to 3.08 ms at context 16k and from 3.77 to 3.60 at 32k (2.64 -> 2.62 at 4k, 2.36 either
# way at 128). Past 32 the merge's tile is 64 splits (``merge_splits_pad``): compiled for sm_90
# the kernel then takes 136 registers a thread at a split count that is no multiple of 16 (3
# programs a SM) and 109 at 48, whose 8 x 48 programs fit 132 SMs in one round and split 16k
# and 32k contexts as the occupancy rule's 50 would (43 and 47 splits used). While every
# program of the grid still counted in at the merge, 50 splits cost 2.37 -> 2.41 ms at context
# 128; unused splits now exit at once.
MAX_SPLITS = 48
# A batch is split until about this many programs per SM are in flight, rounded to the
# nearest whole number of splits. On an H200 (Qwen3-4B heads, 1k contexts, in CUDA graphs)
# three a SM beat four: 64 sequences took 69.9 us a layer unsplit and 75.7 with 2 splits, 24
# sequences 32.7 with 2 splits and 40.3 unsplit, 16 sequences 24.3 with 3 and 24.5 with 5.
PROGRAMS_PER_SM = 3
# The merge's tile of splits that every grid of up to this many shares (``merge_splits_pad``).
SHARED_SPLITS_PAD = 32
# Splits the merge reads per round trip, as one [group, chunk, head_dim] float32 tile.
MERGE_CHUNK = 8


@functools.cache
def min_split_tokens_now() -> int:
    """``MIN_SPLIT_TOKENS``, or ``PEGAINFER_DECODE_MIN_SPLIT`` where set (read once: an
    environment read costs about 0.5 us a launch)."""
    value = int(os.environ.get("PEGAINFER_DECODE_MIN_SPLIT", MIN_SPLIT_TOKENS))
    if value < 1:
        raise ValueError(f"PEGAINFER_DECODE_MIN_SPLIT must be a positive token count, got {value}")
    return value


@functools.cache
def decode_tile_now() -> tuple[int | None, int | None, int | None]:
    """``PEGAINFER_DECODE_BLOCK_N``, ``PEGAINFER_DECODE_STAGES`` and ``PEGAINFER_DECODE_WARPS``
    where set (to try another key tile, pipeline depth or program size in whole steps), else
    ``None`` for the rule's."""
    picked = []
    for name in ("PEGAINFER_DECODE_BLOCK_N", "PEGAINFER_DECODE_STAGES", "PEGAINFER_DECODE_WARPS"):
        value = os.environ.get(name)
        if value is not None and (not value.isdigit() or int(value) < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        picked.append(int(value) if value else None)
    return picked[0], picked[1], picked[2]


def choose_max_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    device: torch.device,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
) -> int:
    """Splits per sequence for the grid: enough programs to fill the GPU, never a split
    shorter than ``min_split_tokens`` at ``max_context_len``. Host integers only."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    pairs = max(num_seqs * num_kv_heads, 1)
    by_length = cdiv(max(max_context_len, 1), min_split_tokens)
    by_occupancy = round(PROGRAMS_PER_SM * sms / pairs)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def merge_splits_pad(max_splits: int) -> int:
    """The merge's tile of splits: 32 for every grid of up to 32 splits (one compiled
    variant for all batches of two sequences and more), 64 beyond (one sequence). With a
    64-split tile a grid of 6 splits compiled to 136 registers a thread against 108 (sm_90,
    Triton 3.9), 3 programs a SM instead of 4, so the grids that fit 32 keep that tile."""
    return max(SHARED_SPLITS_PAD, next_power_of_2(max_splits))
