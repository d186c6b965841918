"""Shared pieces of the paged attention kernel tests (test_kernels_triton_attention.py,
test_kernels_decode_attention.py): a paged KV cache over shuffled blocks, and the check that
every split counter is back at rest."""

from __future__ import annotations

import random

import torch
from triton_test_util import DEVICE, nan_cache, randn

from kernels.attention import store_kv_ref
from kernels.attention_merge import split_counters

# Group sizes 1, 4, 5 (Qwen3-14B's 40 query heads over 8: no power of two) and 8.
GQA = [(2, 2), (8, 2), (10, 2), (8, 1)]
QWEN3_4B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}


def build_paged(cases, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """``cases``: ``(context_len, query_len)`` per sequence. Random K/V of every token are
    written through shuffled physical blocks into a NaN-filled cache."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in cases]
    num_blocks = sum(blocks_needed) + 3
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    k_cache = nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    v_cache = k_cache.clone()
    tables, slots = [], []
    for (ctx, _), count in zip(cases, blocks_needed):
        table = [physical.pop() for _ in range(count)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
    total = len(slots)
    k = randn(total, num_kv_heads, head_dim, g=g, dtype=dtype)
    v = randn(total, num_kv_heads, head_dim, g=g, dtype=dtype)
    store_kv_ref(k, v, k_cache, v_cache, torch.tensor(slots, device=DEVICE))
    width = max(1, max(len(t) for t in tables))
    # Table padding points at a real block: a kernel reading past a context sees data.
    block_tables = torch.tensor(
        [t + [physical[0] if physical else 0] * (width - len(t)) for t in tables],
        dtype=torch.int32,
        device=DEVICE,
    )
    context_lens = torch.tensor([c for c, _ in cases], dtype=torch.int32, device=DEVICE)
    starts = [0]
    for _, query_len in cases:
        starts.append(starts[-1] + query_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = randn(starts[-1], num_heads, head_dim, g=g, dtype=dtype)
    return q, k_cache, v_cache, block_tables, context_lens, query_start_loc


def counters_at_rest() -> bool:
    """The split counters are all back at 0 (the last program of each group resets its)."""
    return not split_counters(0, DEVICE).any()
