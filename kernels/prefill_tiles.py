"""How prefill attention (kernels/prefill_attention.py) is tiled and split over keys: the
query-by-key tile a step takes from its longest query run, and the key splits a grid too
small for the GPU takes. Host integers only."""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from kernels.backend import cdiv, next_power_of_2, num_sms


@dataclass(frozen=True)
class PrefillTile:
    """One compiled shape of the prefill kernel: ``block_m`` rows (queries x the group's
    heads) by ``block_n`` keys, whether the key tiles every row sees skip the causal mask
    (``open_tiles``; off only to compare against one masked loop), and how lazily the
    softmax rescales (``rescale_slack``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    open_tiles: bool
    # > 0: the online softmax rescales its accumulator only when a row's max grows by more
    # than this (log2 units) within a key tile; 0: at every key tile.
    rescale_slack: float = 0.0


# Every tile leaves the key tiles before its diagonal unmasked (``open_tiles``). On an H200
# (Qwen3-4B heads, bf16, paged 16-token blocks, alternated), per layer, 64x64 tiles open
# against masked throughout: eight 1k prompts 0.375 against 0.408 ms, the same with 56
# decode rows 0.413 against 0.464, a 2k prompt 0.205 against 0.227, a 16k prompt 6.13
# against 7.00. A step whose longest query run (a prompt or its chunk) has at least
# LONG_QUERY_TOKENS takes the long tile, 128 rows x 128 keys at 8 warps: a 16k prompt 5.61 ms
# (392 TFLOP/s), 4k queries after a 12k prefix 2.44 against 2.61, a 2k prompt alike (0.207
# against 0.205); shorter runs keep 64x64 (eight 1k prompts 0.398 against 0.375, with decode
# rows 0.500 against 0.413: a decode row fills a 32-query tile). 256x64 tiles took a 16k
# prompt to 5.36 ms but a 2k prompt to 0.437. ``PEGAINFER_PREFILL_LONG_QUERIES`` replaces
# the bound (0: never).
# The long tile rescales lazily (slack 8: probabilities up to 256): 8 warps then skip most
# of the accumulator's multiplies for one tile-wide max. Per layer, two alternated rounds on
# an H200, 128x128 eager against lazy: a 16k prompt 5.39-5.44 against 5.17-5.21 ms (the code
# before both, 5.51-5.56), 32k 20.5 against 19.5-19.9, 8k 1.45-1.53 against 1.41-1.51, 4k
# queries after a 12k prefix 2.32-2.33 against 2.20-2.22. The 64x64 tile at 4 warps lost
# with it (8k 1.63-1.73 against 1.67-1.76, eight 1k prompts 0.34 against 0.36), so it keeps
# rescaling at every tile. 256x64, lazy too, was within 4% of 128x128 either way from 8k up
# (16k 5.11-5.13, 32k 19.9-20.2), not worth a third compiled tile.
LONG_QUERY_TOKENS = 2048
SHORT_TILE = PrefillTile(64, 64, 4, 2, True)
LONG_TILE = PrefillTile(128, 128, 8, 2, True, rescale_slack=8.0)


@functools.cache
def long_query_tokens() -> int:
    """``LONG_QUERY_TOKENS``, or ``PEGAINFER_PREFILL_LONG_QUERIES`` where set (read once)."""
    value = os.environ.get("PEGAINFER_PREFILL_LONG_QUERIES")
    if value is None:
        return LONG_QUERY_TOKENS
    if not value.isdigit():
        raise ValueError(f"PEGAINFER_PREFILL_LONG_QUERIES must be a token count, got {value!r}")
    return int(value)


def prefill_tile(dtype: torch.dtype, head_dim: int, group: int, max_query_len: int) -> PrefillTile:
    """The tile of a step whose longest query run is ``max_query_len`` tokens. Short runs (and
    every prefill graph) take 64x64 tiles in 16-bit types (head_dim 128 keeps a 64x128 float32
    accumulator in registers at 4 warps); float32 takes 32x32 (twice the bytes per element
    in shared memory)."""
    group_pad = next_power_of_2(group)
    if dtype == torch.float32:
        tile = PrefillTile(32, 32, 4, 2, True)
    elif head_dim > 128:
        tile = PrefillTile(64, 32, 8, 2, True)
    else:
        bound = long_query_tokens()
        tile = LONG_TILE if 0 < bound <= max_query_len else SHORT_TILE
    return dataclasses.replace(tile, block_m=max(tile.block_m, group_pad, 16))


# Program order. The GPU places a grid's programs in order, and the work table lists each
# sequence's query tiles last (longest) first. With the KV heads varying fastest, every
# head's longest tiles start before any head's short ones, which evens out the causal tail;
# head-major, the programs running at once share a few heads' keys, which stay in L2 where
# a long context's keys of every head would not. Per layer on an H200 (Qwen3-4B heads, bf16,
# CUDA graphs), heads fastest against head-major: a 1k prompt 35.3 against 46.2 us, 2k 104.5
# against 123.9, eight 1k prompts 247.5 against 256.3, 8k 1,270 against 1,299, 32 queries
# after 4k 23.1 against 26.1, 1k after 4k 210.7 against 231.4; but 16k 5,048 against 4,849,
# 32k 20,229 against 18,750, 4k after 12k 2,274 against 2,059, 8k after 8k 3,858 against
# 3,492 (256 queries after 16k 304 against 298, 2k after 30k 2,519 against 2,548).
HEADS_FASTEST_MAX_QUERIES = 2048
HEADS_FASTEST_MAX_KV_BYTES = 32 << 20


def heads_fastest(max_query_len: int, max_context_len: int, kv_bytes_per_token: int) -> bool:
    """Whether a step's prefill programs take the KV heads fastest: few query tiles a
    sequence (a prefill graph's steps always), or a context whose keys and values of every
    head (``kv_bytes_per_token`` a token, one layer) fit ``HEADS_FASTEST_MAX_KV_BYTES``."""
    context = max(max_context_len, max_query_len)
    return (
        max_query_len <= HEADS_FASTEST_MAX_QUERIES
        or context * kv_bytes_per_token <= HEADS_FASTEST_MAX_KV_BYTES
    )


# A split covers at least this many keys; at most this many splits.
MIN_SPLIT_KEYS = 512
MAX_SPLITS = 16


def choose_prefill_splits(num_programs: int, max_context_len: int, device: torch.device) -> int:
    """Key splits per tile: 1 when the tiles alone fill the GPU (about two programs per SM)
    or the context is short; otherwise enough to fill it. Host integers only."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    if num_programs >= 2 * sms or max_context_len < 2 * MIN_SPLIT_KEYS:
        return 1
    by_length = max_context_len // MIN_SPLIT_KEYS
    return max(1, min(cdiv(2 * sms, num_programs), by_length, MAX_SPLITS))
