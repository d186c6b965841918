"""Triton paged decode attention (the split-K kernel that merges its splits in the kernel)
against the reference: shuffled physical blocks, GQA group sizes 1/4/5/8, block sizes
4/16/32, contexts of 1 and not multiples of the block size, padding rows of a captured
batch, sixteen splits merged twice over; on CUDA also Qwen3-4B shapes and CUDA-graph replay.
The split policy: test_decode_splits.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from attention_test_util import GQA, QWEN3_4B, build_paged, counters_at_rest
from triton_test_util import (
    SEED,
    check,
    gen,
    gpu_only,
    poisoned,
    randn,
    requires_triton,
)

from kernels.attention import paged_attention_ref, paged_attention_triton
from kernels.decode_attention import paged_decode_attention_triton

pytestmark = requires_triton

DECODE_CONTEXTS = [1, 5, 16, 50, 33, 17]


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(num_heads, num_kv_heads, block_size, dtype):
    cases = [(ctx, 1) for ctx in DECODE_CONTEXTS]
    seed = SEED + block_size + num_kv_heads
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, num_heads, num_kv_heads, 32, block_size, dtype, seed
    )
    scale = 32**-0.5
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 1, 50)
    # One split (output written directly) and several (partials merged): 50 tokens in
    # splits of >= 16 use 4 splits, 5 tokens one (written directly by a split grid too), so
    # used counts differ per sequence; in a grid of 16 splits most programs are unused and
    # must neither count in at the merge nor write anything.
    for max_splits in (1, 4, 16):
        with poisoned():
            out = paged_decode_attention_triton(
                q, k_cache, v_cache, tables, ctx_lens, scale, 50,
                max_splits=max_splits, min_split_tokens=16, block_n=16,
            )  # fmt: skip
        check(out, expected, f"decode, {max_splits} splits")
        assert counters_at_rest(), f"{max_splits} splits"


def test_decode_attention_block_size_32_fp16_and_dispatch():
    cases = [(ctx, 1) for ctx in (70, 3, 32)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, 8, 2, 16, 32, torch.float16, SEED + 32
    )
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 1, 70)
    with poisoned():
        out = paged_attention_triton(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 1, 70)
    check(out, expected, "dispatched decode")
    with poisoned():
        out = paged_decode_attention_triton(
            q, k_cache, v_cache, tables, ctx_lens, 0.25, 0, max_splits=3, min_split_tokens=8,
            block_n=16,
        )  # fmt: skip
    check(out, expected, "decode, grid sized from the block tables")


def test_decode_padding_rows_of_a_captured_batch_are_zero():
    """A batch padded to a graph size carries sequences with context 0: they get zeros
    (not NaN), and the real rows are unaffected."""
    cases = [(40, 1), (9, 1)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, 8, 2, 16, 4, torch.float32, SEED + 5
    )
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 1, 40)
    pad_q = torch.cat([q, randn(2, 8, 16, g=gen(8), dtype=torch.float32)])
    pad_tables = torch.cat([tables, torch.zeros_like(tables[:2])])
    pad_lens = torch.cat([ctx_lens, torch.zeros_like(ctx_lens[:2])])
    for max_splits in (1, 4):
        with poisoned():
            out = paged_decode_attention_triton(
                pad_q, k_cache, v_cache, pad_tables, pad_lens, 0.25, 40,
                max_splits=max_splits, min_split_tokens=8, block_n=16,
            )  # fmt: skip
        check(out[:2], expected, "real rows")
        assert torch.equal(out[2:], torch.zeros_like(out[2:])), f"{max_splits} splits"
        assert counters_at_rest(), f"{max_splits} splits"


# (context_len, query_len): whole prompts, decode rows, prefix-cached chunks ending
# mid-block and on block boundaries, a one-token prompt.


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (2, 2)])
def test_decode_sixteen_splits_merged_in_the_kernel_twice(num_heads, num_kv_heads):
    """Decode over up to 16 splits (used counts differ per sequence, a context-0 padding
    row uses none) merged by each sequence's last program, launched twice on the same
    counters."""
    contexts = [700, 257, 33, 1]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        [(c, 1) for c in contexts], num_heads, num_kv_heads, 16, 4, torch.float32, SEED + 43
    )
    pad_tables = torch.cat([tables, torch.zeros_like(tables[:1])])
    pad_lens = torch.cat([ctx_lens, torch.zeros_like(ctx_lens[:1])])
    for attempt in range(2):
        q = randn(len(contexts) + 1, num_heads, 16, g=gen(44 + attempt), dtype=torch.float32)
        expected = paged_attention_ref(
            q[:-1], k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 1, 700
        )
        with poisoned():
            out = paged_decode_attention_triton(
                q, k_cache, v_cache, pad_tables, pad_lens, 0.25, 700,
                max_splits=16, min_split_tokens=16, block_n=16,
            )  # fmt: skip
        check(out[:-1], expected, f"decode, 16 splits, launch {attempt}")
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "context-0 row"
        assert counters_at_rest(), f"launch {attempt} left a counter set"


@gpu_only
@pytest.mark.parametrize("batch,max_ctx", [(1, 8192), (64, 8192), (256, 300)])
def test_decode_attention_qwen3_4b_shapes(batch, max_ctx):
    rng = random.Random(SEED)
    contexts = [rng.randint(1, max_ctx) for _ in range(batch)]
    contexts[0] = max_ctx
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        [(c, 1) for c in contexts], **QWEN3_4B, block_size=16, dtype=torch.bfloat16, seed=SEED
    )
    scale = 128**-0.5
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 1, max_ctx)
    with poisoned():
        out = paged_attention_triton(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 1, max_ctx)
    check(out, expected, f"decode batch {batch}")


@gpu_only
def test_decode_attention_replays_in_a_cuda_graph():
    """Captured once with a grid sized for max_model_len, replayed for new lengths and new
    data: the split count follows each sequence's context on the device."""
    max_model_len, batch = 2048, 8
    contexts = [1, 17, 300, 2048, 700, 64, 5, 1000]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        [(max_model_len, 1)] * batch, **QWEN3_4B, block_size=16, dtype=torch.bfloat16, seed=SEED
    )
    scale = 128**-0.5
    ctx_lens.fill_(1)
    paged_attention_triton(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 1, max_model_len)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(
            q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 1, max_model_len
        )
    for attempt in range(2):
        ctx_lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        q.copy_(randn(*q.shape, g=gen(20 + attempt), dtype=q.dtype))
        graph.replay()
        expected = paged_attention_ref(
            q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 1, max_model_len
        )
        check(out, expected, f"graph replay {attempt}")
        contexts = contexts[::-1]
