"""Paged decode attention for GQA, split along the context (flash-decoding), in Triton.

The reference is ``kernels.attention.paged_attention_ref`` (its batched decode path); the
dispatcher ``kernels.attention.paged_attention`` calls ``paged_decode_attention_triton`` when
every sequence of the batch has one query.

Grid ``(num_seqs, num_kv_heads, max_splits)``. A program takes every query head of one KV
head group (the group's rows share each K/V load; they are padded to 16 rows for
``tl.dot``) over one contiguous split of one sequence's context, and writes the split's
normalised partial output and its log-sum-exp; the last of a sequence's splits to finish
merges them in the same launch (kernels/attention_merge.py). With one split the program
writes the output directly, with no atomics.

How many splits a sequence uses is decided on the device from its own context length (at
least ``min_split_tokens`` per split, at most ``max_splits``; a sequence that uses one
split, or none, is written directly with no merge), so the grid depends only on host
integers. That keeps the launch CUDA-graph capturable: a graph captured with
``max_context_len = max_model_len`` replays correctly for any context length. The programs
of splits a sequence does not use exit before the PDL wait and are not counted at the merge,
so a grid sized for long contexts costs short ones little.

The step's rotary, q/k norm and KV write stay a kernel of their own (kernels/rotary.py):
done inside this kernel, by every split program before its first K/V load, they made
batch-1 decode slower on an H200 (2.57 against 2.55 ms a step at context 128). Programs
taking 1 or 2 of a group's 4 query heads (more programs, fewer splits, each reading the
group's K/V) were slower at every batch: 3.20 / 3.51 against 3.04 ms a step at 8 sequences,
4.40 / 5.83 against 4.03 at 32 (Qwen3-4B, in process). Computed inside the o projection's
programs for one sequence (each tile of o's features attending for its KV head, the heads'
partial products added by the last to finish), batch-1 steps at context 128 took 3.19-3.47
against 3.08 ms on an H100: every tile re-reads the keys and values and streams most of its
weight only after its attention (tools/MEASUREMENTS.md, thirty-sixth session).
"""

from __future__ import annotations

import torch

from kernels import attention_merge, pdl
from kernels.attention_merge import split_counters
from kernels.backend import (
    dot_needs_fp32,
    load_triton,
    next_power_of_2,
    triton_jit,
    use_pdl,
)
from kernels.decode_splits import (
    MERGE_CHUNK,
    choose_max_splits,
    decode_tile_now,
    merge_splits_pad,
    min_split_tokens_now,
)

tl = None  # bound to triton.language by kernels.backend.load_triton()

LOG2_E = 1.4426950408889634


@triton_jit
def _split_bounds(context_len, max_splits, MIN_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(tokens_per_split, splits_used)`` of a sequence, the same in every split program."""
    wanted = tl.maximum((context_len + MIN_SPLIT - 1) // MIN_SPLIT, 1)
    num_splits = tl.minimum(wanted, max_splits)
    per_split = (context_len + num_splits - 1) // num_splits
    per_split = tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
    splits_used = (context_len + per_split - 1) // per_split
    return per_split, splits_used


# Eager decode (no graphs, or a batch past the largest graph) passes block tables as wide as
# the batch's longest context: not specializing that stride keeps one compiled variant.
@triton_jit(do_not_specialize=("stride_table_seq",))
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    split_counters_ptr,
    scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    head_dim,
    max_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Context lengths and block tables are written before the step's first kernel, never by
    # the kernel before this one, so they may be read before waiting on it (kernels/pdl.py).
    context_len = tl.load(context_lens_ptr + seq)
    per_split, splits_used = _split_bounds(context_len, max_splits, MIN_SPLIT, BLOCK_N)
    # A split the sequence does not use has nothing to do: it exits before the wait (an
    # exiting program lets the next kernel launch as its trigger would) and is not counted
    # at the merge. Split 0 always stays, to write an empty sequence's zero output.
    if split >= tl.maximum(splits_used, 1):
        return
    start = split * per_split
    end = tl.minimum(start + per_split, context_len)
    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_cache_head
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    dim_mask = dims < head_dim
    heads = kv_head * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & dim_mask[None, :]
    q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    # Both products take the cache dtype (a float32 q over a bf16 cache, say).
    q = q.to(k_cache_ptr.dtype.element_ty)
    if DOT_FP32:
        q = q.to(tl.float32)

    # The running max starts finite (not -inf), so that exp2(m_old - m_new) is never NaN.
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    # An empty sequence's split 0 (start >= end) skips the loop and leaves l_i = 0.
    for block_start in range(start, end, BLOCK_N):
        tokens = block_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        slots = (
            blocks.to(tl.int64) * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_token
        )
        kv_offsets = (slots + head_offset)[:, None] + dims[None, :]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        # Masked loads give 0 for slots past the end: stale cache values (even NaN) never
        # reach the products below. V is loaded with K, not after the softmax: a short
        # split's loop is one round of dependent loads, and V then costs no round of its own.
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p is rounded to the cache dtype for the tensor-core product, as on the GPU.
        p_low = p.to(v.dtype)
        if DOT_FP32:
            p_low = p_low.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    partial = acc / safe_l[:, None]
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + out_offsets, partial.to(out_ptr.dtype.element_ty), mask=q_mask)
    elif splits_used <= 1:
        # One split used (or none: a padding row, whose split 0 holds zeros): split 0, the
        # only program left, writes the output as in a one-split grid and does not count in.
        # That saves the scratch store, the atomic and the merge's loads, a chain of round
        # trips that dominates short contexts.
        tl.store(out_ptr + out_offsets, partial.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partial_out: [num_seqs, num_heads, max_splits, head_dim] float32, contiguous.
        num_heads = tl.num_programs(1) * GROUP
        first_row = (seq * num_heads + heads) * max_splits  # split 0's scratch row
        row_index = first_row + split
        tl.store(
            partial_out_ptr + row_index[:, None] * head_dim + dims[None, :],
            partial,
            mask=q_mask,
        )
        lse = m_i + tl.log2(safe_l)
        tl.store(partial_lse_ptr + row_index, lse, mask=rows < GROUP)
        # The splits_used programs left (each computed the same count) count in; the last
        # merges their partials.
        counter = split_counters_ptr + seq * tl.num_programs(1) + kv_head
        if attention_merge.arrive_last(counter, splits_used):
            # The group's real rows only (not the tl.dot padding): a smaller tile lets more
            # splits' loads be in flight at once.
            m_rows = tl.arange(0, GROUP_M)
            m_heads = kv_head * GROUP + m_rows
            m_mask = m_rows < GROUP
            merged = attention_merge.merge_split_chunks(
                partial_out_ptr,
                partial_lse_ptr,
                (seq * num_heads + m_heads) * max_splits,
                splits_used,
                m_mask,
                dims,
                head_dim,
                GROUP_M,
                HEAD_DIM,
                SPLITS_PAD,
                MERGE_CHUNK,
            )
            m_offsets = seq * stride_out_seq + m_heads[:, None] * stride_out_head + dims[None, :]
            tl.store(
                out_ptr + m_offsets,
                merged.to(out_ptr.dtype.element_ty),
                mask=m_mask[:, None] & dim_mask[None, :],
            )
            tl.store(counter, 0)  # ready for the next launch (or graph replay)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int = 0,
    *,
    max_splits: int | None = None,
    min_split_tokens: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge_chunk: int = MERGE_CHUNK,
) -> torch.Tensor:
    """Attention of one query per sequence, ``q [num_seqs, num_heads, head_dim]``.

    No host sync: ``max_context_len`` (0: the block tables' capacity) only sizes the grid,
    and a sequence whose context is empty gets a zero output.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same layout with unit last stride")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    load_triton()
    group = num_heads // num_kv_heads
    if max_context_len <= 0:
        max_context_len = block_tables.shape[1] * block_size
    if min_split_tokens is None:
        min_split_tokens = min_split_tokens_now()
    if max_splits is None:
        max_splits = choose_max_splits(
            num_seqs, num_kv_heads, max_context_len, q.device, min_split_tokens
        )
    fp32 = k_cache.dtype == torch.float32  # q is cast to the cache dtype in the kernel
    env_block_n, env_stages, env_warps = decode_tile_now()
    if block_n is None and not fp32:
        block_n = env_block_n
    if num_stages is None:
        num_stages = env_stages
    if num_warps is None:
        num_warps = env_warps or 4
    if block_n is None:
        # 64-key tiles: fewer dependent loads per program (1k contexts on an H200: 14.6 vs
        # 17.2 us at 8 sequences). At 32 sequences 32-key tiles measured 5% faster, but a
        # second compiled variant slowed start-up and larger batches lost with them. 128-key
        # tiles (one program up to 128 tokens, no merge) lost in whole steps: batch 1 at
        # context 128 / 4k 2.53 / 2.77 ms against 2.37 / 2.66, batch 32 4.45 against 4.15
        # (alternated; 8 warps or 2 stages no better).
        block_n = 32 if fp32 else 64
    single = max_splits == 1
    if num_stages is None:
        # Three tiles in flight. Measured on an H200 (Qwen3-4B heads, in CUDA graphs, KV out
        # of L2, a 40k-token grid bound), against one stage for one sequence and two for
        # more: one sequence at 16k 29.6 against 35.0 us, at 4k 12.6 against 13.0; 8 at 1k
        # 17.1 against 17.9; within 0.4 us elsewhere (one sequence at 1-1k, 2-64 at 1k).
        # Three stages fetch the block table two tiles ahead but hold one K/V buffer; five
        # hold two. Five measured slower in whole steps (batch 1: 2.74 against 2.56 ms at
        # context 128, 2.96 against 2.84 at 4k); alone they won only with 32-key tiles at 4k
        # and longer (4k: 10.96 against 11.56 us), and lost at 128 and at 8-64 sequences.
        num_stages = 3
    if single:
        partial_out = partial_lse = out  # unused by the single-split kernel
        counters = context_lens  # unused
    else:
        partial_out = torch.empty(
            (num_seqs, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_heads, max_splits), dtype=torch.float32, device=q.device
        )
        counters = split_counters(num_seqs * num_kv_heads, q.device)
    head_dim_pad = next_power_of_2(head_dim)
    group_pad = max(16, next_power_of_2(group))  # tl.dot wants 16 rows
    with_pdl = use_pdl(q)
    _decode_split_kernel[(num_seqs, num_kv_heads, max_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        partial_out,
        partial_lse,
        counters,
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
        max_splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        MIN_SPLIT=min_split_tokens,
        SINGLE_SPLIT=single,
        PRECISION="ieee" if fp32 else "tf32",
        DOT_FP32=dot_needs_fp32(k_cache.dtype),
        GROUP_M=next_power_of_2(group),
        SPLITS_PAD=merge_splits_pad(max_splits),
        MERGE_CHUNK=merge_chunk,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "decode_attention"),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_options(with_pdl),
    )
    return out


def decode_bytes(
    num_seqs: int, context_len: int, num_heads: int, num_kv_heads: int, head_dim: int, elem: int
) -> int:
    """Bytes a decode step of attention must move (K and V read, q read, out written)."""
    kv = 2 * num_seqs * context_len * num_kv_heads * head_dim * elem
    return kv + 2 * num_seqs * num_heads * head_dim * elem
