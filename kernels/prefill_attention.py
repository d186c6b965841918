"""Prefill attention over the paged KV cache, in Triton (flash-attention style).

The reference is ``kernels.attention.paged_attention_ref``. Varlen batch: sequence ``s``
owns query rows ``query_start_loc[s] : query_start_loc[s + 1]``; query ``i`` of it sits at
position ``context_lens[s] - query_len + i`` and attends to keys ``0 .. position``, read
from the cache through the block table (the step's keys are already stored, and a cached
prefix is simply more keys). So one kernel serves whole prompts, chunked prefill, prefix
hits and, in a mixed batch, decode rows.

A one-dimensional grid of work items x splits x KV heads, the heads varying fastest or
slowest (``kernels.prefill_tiles.heads_fastest`` says which). The ``BLOCK_M`` rows of a
query tile are ``BLOCK_M // GROUP_PAD`` consecutive queries times every query head of one
KV head group, so each K/V tile loaded from the cache serves the whole group. Scores and
the online softmax are float32 (exp2, scale folded in); both products run in the input
dtype on tensor cores with float32 accumulation. The key tiles that every row of a query
tile sees (those before its first query's position) run without the causal mask or key
bounds; only the tiles on the diagonal are masked. The tile grows for long query runs
(``prefill_tile``).

Which tile of which sequence a program takes comes from a work table
(kernels/prefill_work.py): one entry per query tile of the batch, built on the device from
``query_start_loc`` once per step and shared by every layer, then ``-1`` up to
``cdiv(num_tokens, queries_per_tile) + num_seqs`` entries, the most any batch of that many
tokens and sequences can have. A grid of every sequence times the longest sequence's tiles
would be mostly programs that exit at once: a mixed batch of one 1,024-token prompt and 30
decodes launched 16k of them for 760 with work, and a captured graph, sized for its
largest batch, more still; each empty program still holds a full program's registers.

A few queries over a long context (a prompt's tail after a prefix-cache hit) give too few
programs to fill the GPU, each walking thousands of keys. Then the keys are also split
(``num_splits`` programs per tile, each over one contiguous range): every program writes
its rows' normalised partial output and log-sum-exp, and kernels/prefill_merge.py combines
them, as decode attention does. The number of splits is a host integer chosen from the grid
and ``max_context_len``; how many keys each split covers is decided on the device from the
sequence's own context, so a captured graph replays for any context length.
"""

from __future__ import annotations

import torch

from kernels.backend import (
    cdiv,
    dot_needs_fp32,
    load_triton,
    next_power_of_2,
    triton_jit,
)
from kernels.prefill_merge import merge_prefill_splits
from kernels.prefill_tiles import choose_prefill_splits, prefill_tile
from kernels.prefill_tiles import heads_fastest as choose_heads_fastest
from kernels.prefill_work import prefill_work_table_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

LOG2_E = 1.4426950408889634


@triton_jit
def _attend_key_tile(
    q,
    m_i,
    l_i,
    acc,
    block_start,
    kv_end,
    positions,
    table_row,
    head_offset,
    k_cache_ptr,
    v_cache_ptr,
    stride_cache_block,
    stride_cache_token,
    dims,
    dim_mask,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    MASKED: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
):
    """One key tile of the online softmax: ``(m_i, l_i, acc)`` updated. ``MASKED``: the tile
    may reach past ``kv_end`` or past a row's position (the causal diagonal).
    ``RESCALE_SLACK`` > 0: the running max (log2 units) moves only when some row's grows by
    more than that, so most tiles skip rescaling ``acc``; the probabilities are then up to
    ``2 ** RESCALE_SLACK``, exact in the final ratio ``acc / l_i``."""
    keys = block_start + tl.arange(0, BLOCK_N)
    key_mask = keys < kv_end
    if MASKED:
        blocks = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0)
    else:
        blocks = tl.load(table_row + keys // BLOCK_SIZE)
    slots = blocks.to(tl.int64) * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_token
    kv_offsets = (slots + head_offset)[:, None] + dims[None, :]
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_offsets, mask=dim_mask[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
    # Unscaled scores: the scale goes into the max and into one multiply-add before exp2.
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        # Causal: a key at or before the row's position (keys < kv_end by the mask).
        visible = (keys[None, :] <= positions[:, None]) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale_log2)
    if RESCALE_SLACK > 0:
        if tl.max(m_new - m_i, axis=0) > RESCALE_SLACK:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.exp2(scores * scale_log2 - m_i[:, None])
        l_i = l_i + tl.sum(p, axis=1)
        m_new = m_i
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
    if MASKED:
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_offsets, mask=dim_mask[None, :], other=0.0)
    p_low = p.to(v.dtype)
    if DOT_FP32:
        p_low = p_low.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p_low, v, acc, input_precision=PRECISION)
    return m_new, l_i, acc


# The block tables' row stride is their width, which follows the longest context of an eager
# batch: specialized, a width that happens to be a multiple of 16 compiled a second variant
# in the middle of serving (0.7 s on an H200, seen as one slow batch of requests).
@triton_jit(do_not_specialize=("num_splits", "num_tokens", "stride_table_seq", "heads_fastest"))
def _prefill_kernel(
    work_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    stride_out_token,
    stride_out_head,
    head_dim,
    num_splits,
    partial_out_ptr,
    partial_lse_ptr,
    num_tokens,
    heads_fastest,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    OPEN_TILES: tl.constexpr,
    RESCALE_SLACK: tl.constexpr,
):
    if heads_fastest != 0:
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        item = tl.program_id(0) // NUM_KV_HEADS
    else:
        items = tl.num_programs(0) // NUM_KV_HEADS
        kv_head = tl.program_id(0) // items
        item = tl.program_id(0) % items
    work = tl.load(work_ptr + item // num_splits)
    split = item % num_splits
    # An entry is seq << 16 | tile. A -1 (no work: the table's slack, most of a captured
    # graph's grid) loads nothing more and finds no query.
    live = work >= 0
    seq = tl.maximum(work >> 16, 0).to(tl.int64)
    tile = work & 0xFFFF
    query_start = tl.load(query_start_loc_ptr + seq, mask=live, other=0)
    query_len = tl.load(query_start_loc_ptr + seq + 1, mask=live, other=0) - query_start
    context_len = tl.load(context_lens_ptr + seq, mask=live, other=0)
    queries_per_tile = BLOCK_M // GROUP_PAD
    first_query = tile * queries_per_tile
    if first_query < query_len:
        rows = tl.arange(0, BLOCK_M)
        query = first_query + rows // GROUP_PAD
        group_index = rows % GROUP_PAD
        # Padding rows (past the sequence, or past the group) compute harmlessly on zero
        # queries and are never stored.
        row_valid = (query < query_len) & (group_index < GROUP)
        heads = kv_head * GROUP + group_index
        dims = tl.arange(0, HEAD_DIM)
        dim_mask = dims < head_dim
        token = (query_start + query).to(tl.int64)
        q_offsets = token[:, None] * stride_q_token + heads[:, None] * stride_q_head
        q_mask = row_valid[:, None] & dim_mask[None, :]
        q = tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)
        # Both products take the cache dtype (a float32 q over a bf16 cache, say).
        q = q.to(k_cache_ptr.dtype.element_ty)
        if DOT_FP32:
            q = q.to(tl.float32)
        positions = context_len - query_len + query
        last_query = tl.minimum(first_query + queries_per_tile, query_len) - 1
        kv_end = context_len - query_len + last_query + 1

        kv_begin = 0
        if SPLIT:
            per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
            kv_begin = split * per_split
            kv_end = tl.minimum(kv_end, kv_begin + per_split)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        table_row = block_tables_ptr + seq * stride_table_seq
        head_offset = kv_head * stride_cache_head
        # With OPEN_TILES, keys up to the tile's first position (visible to every row) run
        # in whole key tiles without the causal mask or the key bounds, and only the tiles
        # on the diagonal pay for both. An empty range (a split past this tile's last key)
        # skips both loops: l_i stays 0.
        open_end = kv_begin
        if OPEN_TILES:
            first_position = context_len - query_len + first_query
            open_keys = tl.maximum(tl.minimum(kv_end, first_position + 1) - kv_begin, 0)
            open_end = kv_begin + open_keys // BLOCK_N * BLOCK_N
            for block_start in range(kv_begin, open_end, BLOCK_N):
                m_i, l_i, acc = _attend_key_tile(
                    q, m_i, l_i, acc, block_start, kv_end, positions, table_row, head_offset,
                    k_cache_ptr, v_cache_ptr, stride_cache_block, stride_cache_token, dims,
                    dim_mask, scale_log2, BLOCK_SIZE, BLOCK_N, PRECISION, DOT_FP32, False,
                    RESCALE_SLACK,
                )  # fmt: skip
        for block_start in range(open_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_key_tile(
                q, m_i, l_i, acc, block_start, kv_end, positions, table_row, head_offset,
                k_cache_ptr, v_cache_ptr, stride_cache_block, stride_cache_token, dims,
                dim_mask, scale_log2, BLOCK_SIZE, BLOCK_N, PRECISION, DOT_FP32, True,
                RESCALE_SLACK,
            )  # fmt: skip

        # A row that saw no key (only if query_len > context_len: bad input) writes 0.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if SPLIT:
            # partial_out [num_splits, num_tokens, num_heads, head_dim], lse alike without
            # head_dim; a row with no visible key in this split weighs 0 in the merge.
            num_heads = NUM_KV_HEADS * GROUP
            row_index = (split * num_tokens + token) * num_heads + heads
            tl.store(
                partial_out_ptr + row_index[:, None] * head_dim + dims[None, :],
                out,
                mask=q_mask,
            )
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), -float("inf"))
            tl.store(partial_lse_ptr + row_index, lse, mask=row_valid)
        else:
            out_offsets = token[:, None] * stride_out_token + heads[:, None] * stride_out_head
            tl.store(
                out_ptr + out_offsets + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=q_mask,
            )


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int = 0,
    max_context_len: int = 0,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    open_tiles: bool | None = None,
    rescale_slack: float | None = None,
    num_splits: int | None = None,
    split_seqs: int = 0,
    work_table: torch.Tensor | None = None,
    heads_fastest: bool | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, num_heads, head_dim]`` over the paged cache.

    ``work_table``: this batch's ``kernels.prefill_work_table`` for the default tiles,
    which a caller running many layers over one batch builds once; else it is built here.

    ``max_query_len`` sizes the grid; when 0 it is read from ``query_start_loc`` (one host
    sync, fine for eager prefill). ``max_context_len`` (0: unknown, no split) decides the
    split over keys unless ``num_splits`` is given, planned for ``split_seqs`` sequences
    (0: all of the batch's). ``heads_fastest`` (None: ``kernels.prefill_tiles``' rule)
    orders the programs; the result is the same either way. Rows of ``q`` past
    ``query_start_loc[-1]`` are not written.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same layout with unit last stride")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len <= 0:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if max_query_len <= 0:
        return out
    load_triton()
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    tile = prefill_tile(k_cache.dtype, head_dim, group, max_query_len)
    block_m = max(block_m or tile.block_m, group_pad, 16)
    block_n = block_n or tile.block_n
    num_warps = num_warps or tile.num_warps
    num_stages = num_stages or tile.num_stages
    if open_tiles is None:
        open_tiles = tile.open_tiles
    if rescale_slack is None:
        rescale_slack = tile.rescale_slack
    queries_per_tile = block_m // group_pad
    if work_table is None:
        work_table = prefill_work_table_triton(query_start_loc, num_tokens, queries_per_tile)
    elif work_table.shape != (cdiv(num_tokens, queries_per_tile) + num_seqs,):
        raise ValueError(
            f"work table of shape {tuple(work_table.shape)} is not for {num_tokens} tokens "
            f"in {num_seqs} sequences at {queries_per_tile} queries a tile"
        )
    fp32 = k_cache.dtype == torch.float32  # q is cast to the cache dtype in the kernel
    tiles = cdiv(max_query_len, queries_per_tile)
    if num_splits is None:
        num_splits = choose_prefill_splits(
            tiles * num_kv_heads * min(split_seqs or num_seqs, num_seqs), max_context_len, q.device
        )
    split = num_splits > 1
    if split:
        partial_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device
        )
    else:
        partial_out = partial_lse = out  # unused
    grid = (work_table.shape[0] * num_splits * num_kv_heads,)
    if heads_fastest is None:
        kv_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
        heads_fastest = choose_heads_fastest(max_query_len, max_context_len, kv_bytes)
    _prefill_kernel[grid](
        work_table,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim,
        num_splits,
        partial_out,
        partial_lse,
        num_tokens,
        int(heads_fastest),
        GROUP=group,
        GROUP_PAD=group_pad,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION="ieee" if fp32 else "tf32",
        DOT_FP32=dot_needs_fp32(k_cache.dtype),
        SPLIT=split,
        OPEN_TILES=open_tiles,
        RESCALE_SLACK=float(rescale_slack),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        merge_prefill_splits(partial_out, partial_lse, query_start_loc, out, num_seqs, num_splits)
    return out
