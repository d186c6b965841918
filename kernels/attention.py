"""The paged KV cache: writing new keys/values into it, and attention over it.

Cache layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``p`` of a sequence lives in physical block ``block_table[p //
block_size]`` at offset ``p % block_size``; its flat slot is ``block * block_size + offset``.

The batch is flat (varlen): sequence ``i`` owns query rows ``query_start_loc[i] :
query_start_loc[i + 1]``. Those are its newest tokens, at positions ``context_lens[i] -
query_len .. context_lens[i] - 1``, and they attend causally to its tokens ``0 ..
context_lens[i] - 1`` already in the cache (the step's own keys are stored first). One call
therefore serves prefill, chunked prefill, prefix-cached prefill and decode alike.

On CUDA the dispatchers run Triton: ``store_kv_triton`` here, the split-K decode kernel
(kernels/decode_attention.py) for decode-only batches and the flash-style prefill kernel
(kernels/prefill_attention.py) for everything else; ``paged_attention_ref`` is the
reference of both. The fused rotary + cache write is in kernels/rotary.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import load_triton, next_power_of_2, triton_jit, use_triton
from kernels.decode_attention import paged_decode_attention_triton
from kernels.prefill_attention import paged_prefill_attention_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k, v [T, num_kv_heads, head_dim]`` to their slots. A negative slot marks a
    padding token (a batch padded up to a captured graph size) and is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length]


# Bound on gathered key elements per batched decode chunk (K and V each, in float32).
_DECODE_CHUNK_ELEMENTS = 1 << 24


def _decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """One query per sequence: gather every sequence's keys padded to ``max_context_len``
    and attend in one batched SDPA call, instead of one call per sequence. Needs no host
    sync, so decode on the reference path is not bound by Python per sequence."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_context_len // block_size)
    padded_len = num_blocks * block_size
    per_seq = padded_len * num_kv_heads * head_dim
    chunk = max(1, _DECODE_CHUNK_ELEMENTS // per_seq)
    key_positions = torch.arange(padded_len, device=q.device)
    out = torch.empty_like(q)
    for start in range(0, num_seqs, chunk):
        end = min(start + chunk, num_seqs)
        tables = block_tables[start:end, :num_blocks].long()
        valid = key_positions.unsqueeze(0) < context_lens[start:end].unsqueeze(1)
        # Slots past a sequence's end (and padding blocks) hold stale or uninitialised
        # values; zero them so a NaN there cannot leak through a zero attention weight.
        keep = valid.view(end - start, padded_len, 1, 1)
        keys = k_cache[tables].view(end - start, padded_len, num_kv_heads, head_dim)
        values = v_cache[tables].view(end - start, padded_len, num_kv_heads, head_dim)
        keys = keys.float().masked_fill(~keep, 0.0).transpose(1, 2)
        values = values.float().masked_fill(~keep, 0.0).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[start:end].float().unsqueeze(2),  # [n, num_heads, 1, head_dim]
            keys,
            values,
            attn_mask=valid.view(end - start, 1, 1, padded_len),
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = o.squeeze(2).to(q.dtype)
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int = 0,
    max_context_len: int = 0,
) -> torch.Tensor:
    """Causal attention of ``q [T, num_heads, head_dim]`` over the paged cache.

    Gathers each sequence's keys and values and runs SDPA in float32 (so the softmax is
    float32 whatever the model dtype). A decode-only batch (``max_query_len == 1`` with
    ``max_context_len`` given) is batched into one call; otherwise one call per sequence.
    A GPU kernel uses ``max_query_len``/``max_context_len`` to size its grid.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    if max_query_len == 1 and max_context_len > 0:
        return _decode_attention_ref(
            q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len
        )
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        if query_len > context_len:
            raise ValueError(f"sequence {i}: {query_len} queries but context of {context_len}")
        keys = _gather_sequence(k_cache, block_tables[i], context_len)
        values = _gather_sequence(v_cache, block_tables[i], context_len)
        q_i = q[start:end].float().transpose(0, 1)  # [num_heads, query_len, head_dim]
        k_i = keys.float().transpose(0, 1)  # [num_kv_heads, context_len, head_dim]
        v_i = values.float().transpose(0, 1)
        mask = None
        is_causal = False
        if query_len == context_len:
            is_causal = True  # square: SDPA's top-left causal mask is the right one
        elif query_len > 1:
            # Query row r sits at position context_len - query_len + r (bottom-right aligned).
            rows = torch.arange(query_len, device=q.device).unsqueeze(1)
            cols = torch.arange(context_len, device=q.device).unsqueeze(0)
            mask = cols <= rows + (context_len - query_len)
        o_i = F.scaled_dot_product_attention(
            q_i,
            k_i,
            v_i,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = o_i.transpose(0, 1).to(q.dtype)
    return out


@triton_jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, KV_HEADS)
    dims = tl.arange(0, HEAD_DIM)
    # A negative slot (padding token) writes no head.
    head_mask = heads < tl.where(slot >= 0, num_kv_heads, 0)
    mask = head_mask[:, None] & (dims < head_dim)[None, :]
    k = tl.load(
        k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    dst = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need the same layout with unit last stride")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("KV cache blocks must be laid out back to back")
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    load_triton()
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        KV_HEADS=next_power_of_2(num_kv_heads),
        HEAD_DIM=next_power_of_2(head_dim),
        num_warps=2,
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int = 0,
    max_context_len: int = 0,
    split_seqs: int = 0,
    work_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode batches (``max_query_len == 1``, one row per sequence) take the split-K decode
    kernel, which never syncs with the host and so can be captured in a CUDA graph; every
    other batch (prefill, chunked, mixed) takes the prefill kernel, for which a decode row
    is just a query of length 1."""
    if max_query_len == 1 and q.shape[0] == context_lens.shape[0]:
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len
        )
    return paged_prefill_attention_triton(
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale,
        max_query_len,
        max_context_len,
        split_seqs=split_seqs,
        work_table=work_table,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int = 0,
    max_context_len: int = 0,
    split_seqs: int = 0,
    work_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, num_heads, head_dim]`` over the paged cache (see the
    module docstring). Pass ``max_query_len``/``max_context_len`` as host integers: with
    them the decode path never syncs and can be captured in a CUDA graph (there,
    ``max_context_len`` only sizes the split grid; ``max_model_len`` is always correct).
    ``split_seqs`` (0: all) is how many sequences a prefill's split over keys is planned
    for; it changes how the work is spread, never the result. ``work_table``: the batch's
    ``prefill_work_table``, when a caller shares one over layers (prefill kernel only)."""
    args = (q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale)
    if use_triton(q):
        return paged_attention_triton(*args, max_query_len, max_context_len, split_seqs, work_table)
    return paged_attention_ref(*args, max_query_len, max_context_len)
