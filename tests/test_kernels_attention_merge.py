"""The in-kernel split merge (kernels/attention_merge.py): the persistent counter buffer,
the last-arrival test and the merge of partials, each on its own; on CUDA also split
attention replayed in a CUDA graph. The decode kernel that uses them is tested against the
reference in test_kernels_decode_attention.py.
"""

from __future__ import annotations

import pytest
import torch
from attention_test_util import QWEN3_4B, build_paged
from triton_test_util import DEVICE, SEED, check, gen, gpu_only, randn, requires_triton

import kernels.attention_merge as attention_merge
from kernels.attention import paged_attention_ref, paged_attention_triton
from kernels.attention_merge import MIN_COUNTERS, split_counters
from kernels.backend import load_triton, triton_jit

pytestmark = requires_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()


@pytest.fixture
def fresh_counters(monkeypatch):
    monkeypatch.setattr(attention_merge, "_counter_buffers", {})


def test_split_counters_are_zeroed_reused_and_grow_without_freeing(fresh_counters):
    first = split_counters(10, DEVICE)
    assert first.dtype == torch.int32 and first.numel() == MIN_COUNTERS
    assert not first.any()
    assert split_counters(MIN_COUNTERS, DEVICE) is first  # fits: the same buffer
    grown = split_counters(MIN_COUNTERS + 1, DEVICE)
    assert grown is not first and grown.numel() >= 2 * MIN_COUNTERS and not grown.any()
    assert split_counters(3, DEVICE) is grown
    # A graph captured on the first buffer keeps using its address: it must stay allocated.
    (held,) = attention_merge._counter_buffers.values()
    assert len(held) == 2 and held[0] is first and held[1] is grown


@triton_jit
def _count_in_kernel(counters_ptr, arrivals_ptr, num_splits):
    group = tl.program_id(0) // num_splits
    if attention_merge.arrive_last(counters_ptr + group, num_splits):
        tl.atomic_add(arrivals_ptr + group, 1)
        tl.store(counters_ptr + group, 0)


@triton_jit
def _merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    num_rows,
    num_splits,
    head_dim,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < num_rows
    # partial_out [num_rows, num_splits, head_dim]: a row's splits are contiguous.
    merged = attention_merge.merge_split_chunks(
        partial_out_ptr,
        partial_lse_ptr,
        rows.to(tl.int64) * num_splits,
        num_splits,
        row_mask,
        dims,
        head_dim,
        ROWS,
        HEAD_DIM,
        SPLITS_PAD,
        CHUNK,
    )
    mask = row_mask[:, None] & (dims < head_dim)[None, :]
    tl.store(out_ptr + rows[:, None] * head_dim + dims[None, :], merged, mask=mask)


def test_exactly_one_program_per_group_arrives_last(fresh_counters):
    load_triton()
    groups, num_splits = 5, 7
    counters = split_counters(groups, DEVICE)
    arrivals = torch.zeros(groups, dtype=torch.int32, device=DEVICE)
    for launch in range(2):  # the reset leaves the counters ready for the next launch
        _count_in_kernel[(groups * num_splits,)](counters, arrivals, num_splits)
        assert arrivals.tolist() == [launch + 1] * groups
        assert not counters.any()


@pytest.mark.parametrize("chunk", [1, 4, 8])
def test_merge_weights_partials_by_their_log_sum_exp(chunk):
    """Rows whose splits saw keys merge to the softmax-weighted mean (lse spread over a
    wide range, some splits empty; 6 splits are not a multiple of 4, and fewer than 8); a
    row no split saw merges to 0, not NaN."""
    load_triton()
    num_splits, rows, head_dim = 6, 5, 24
    g = gen(50)
    partial = torch.randn(num_splits, rows, head_dim, generator=g)
    lse = 40.0 * torch.randn(num_splits, rows, generator=g)
    lse[1, 0] = lse[4, 2] = -float("inf")  # splits with no key of the row
    lse[:, 3] = -float("inf")  # a row with no key at all
    partial[1, 0] = partial[4, 2] = 1e30  # an empty split's output weighs 0 whatever it is
    weights = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=0).nan_to_num(0.0)
    expected = (weights.unsqueeze(-1) * partial.clamp(-1e3, 1e3)).sum(0)
    out = torch.full((rows, head_dim), float("nan"), device=DEVICE)
    by_row = partial.transpose(0, 1).contiguous().to(DEVICE)
    _merge_kernel[(1,)](
        by_row, lse.t().contiguous().to(DEVICE), out, rows, num_splits, head_dim,
        ROWS=8, HEAD_DIM=32, SPLITS_PAD=8, CHUNK=chunk,
    )  # fmt: skip
    assert torch.equal(out[3].cpu(), torch.zeros(head_dim))
    keep = [0, 1, 2, 4]
    check(out[keep].cpu(), expected[keep], "merged partials")


@gpu_only
def test_split_prefill_replays_in_a_cuda_graph():
    """A prefix hit's 32-token tail, split 16 ways and captured once: every replay (new
    queries, new context lengths) matches the reference."""
    cases = [(4096, 32)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, **QWEN3_4B, block_size=16, dtype=torch.bfloat16, seed=SEED
    )
    scale = 128**-0.5
    args = (q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 32, 40960, 1)
    paged_attention_triton(*args)  # warm-up: compiles and sizes the counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(*args)
    for attempt, context in enumerate((4096, 1000, 33, 4096)):
        ctx_lens.fill_(context)
        q.copy_(randn(*q.shape, g=gen(60 + attempt), dtype=q.dtype))
        graph.replay()
        expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 32, 4096)
        check(out, expected, f"graph replay {attempt}, context {context}")
