"""Each row's ``k`` largest values and their column ids, sorted descending, without a
radix select over the whole row.

The sampler's candidate path (Qwen3's recommended top-k 20) draws from each row's 128 largest
logits. ``torch.topk`` over a 152k-entry vocabulary runs radix passes over every row, at a
small share of the memory bandwidth on large batches. Here the row is read twice, in four
launches:

1. The row's columns fall into ``GROUPS`` strided groups (column mod ``GROUPS``), and each
   group's largest value is found. These are ``GROUPS`` distinct entries of the row, so the
   ``k``-th largest of them is a lower bound of the row's ``k``-th largest value: every one of
   the row's top ``k`` is at least that bound. On random rows of Qwen3's vocabulary with 256
   groups, about 180 entries pass a bound of ``k`` 128 (at most 213 over 2,000 rows).
2. The entries at or over the bound (and above -inf) are gathered, in any order, into
   ``SLOTS`` slots a row, each chunk's at once through one atomic count of the row (most
   chunks hold none and take no atomic);
3. one program a row redoes a row whose entries over its bound did not fit its slots (a row
   of many equal values, or one with more than ``SLOTS`` finite values and fewer than ``k``
   groups holding any), exactly: the ``k``-th largest value found a few bits of its ordered
   key a pass (counts over the row), then the entries above it and as many entries equal to
   it as the ``k`` leave, in column order;
4. one program a row sorts its slots by value, then column (so ties keep the smaller
   columns, whatever order the gathering took), and writes the first ``k``. ``topk`` is free
   to keep any of the ties at the ``k``-th value; these are the smaller columns.

The first two launches split a row into chunks, one program each; the last program of a row
to arrive in the first (kernels/attention_merge.py's ``arrive_last``) reduces the chunks'
group maxima to the bound.

A row with fewer than ``k`` finite values gets -inf for the rest, with column 0. NaN values
are never gathered. The reference is ``top_candidates_ref``, ``torch.topk``.
"""

from __future__ import annotations

import torch

from kernels import attention_merge
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

GROUPS = 256
CHUNK = 8192  # a multiple of GROUPS
# Columns a program of the gathering launch reads: its prefix sum over them holds registers.
GATHER_CHUNK = 2048
GATHER_WARPS = 8
SLOTS = 1024
# Columns a program reads at once when it redoes an overflowing row alone.
EXACT_BLOCK = 1024
REDO_BY_HISTOGRAM = True


def top_candidates_ref(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [rows, vocab]`` (any float dtype), ``k <= vocab`` -> ``(top [rows, k]``
    float32 sorted descending, ``ids [rows, k]`` int64 columns)."""
    top, ids = values.topk(k, dim=-1)
    return top.float(), ids


@triton_jit
def _group_max_kernel(
    values_ptr,
    partial_ptr,
    bound_ptr,
    slot_values_ptr,
    slot_ids_ptr,
    counters_ptr,
    vocab,
    stride_row,
    num_chunks,
    k,
    GROUPS: tl.constexpr,
    CHUNK: tl.constexpr,
    SLOTS: tl.constexpr,
    FILL: tl.constexpr,
):
    """Each chunk's group maxima; the row's last program reduces them to the row's bound.
    Each program also empties its share of the row's slots for the gathering launch."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    groups = tl.arange(0, GROUPS)
    columns = chunk * CHUNK + tl.arange(0, CHUNK // GROUPS)[:, None] * GROUPS + groups[None, :]
    tile = tl.load(
        values_ptr + row * stride_row + columns, mask=columns < vocab, other=float("-inf")
    )
    tl.store(partial_ptr + (row * num_chunks + chunk) * GROUPS + groups, tl.max(tile, axis=0))
    fill = chunk + num_chunks * tl.arange(0, FILL)
    tl.store(slot_values_ptr + row * SLOTS + fill, float("-inf"), mask=fill < SLOTS)
    tl.store(slot_ids_ptr + row * SLOTS + fill, 0, mask=fill < SLOTS)
    if attention_merge.arrive_last(counters_ptr + row * 2, num_chunks):
        maxima = tl.full((GROUPS,), float("-inf"), tl.float32)
        for other in range(num_chunks):
            partial = tl.load(
                partial_ptr + (row * num_chunks + other) * GROUPS + groups, cache_modifier=".cg"
            )
            maxima = tl.maximum(maxima, partial.to(tl.float32))
        ordered = tl.sort(maxima, descending=True)
        tl.store(bound_ptr + row, tl.max(tl.where(groups == k - 1, ordered, float("-inf")), 0))
        tl.store(counters_ptr + row * 2, 0)  # ready for the next launch


@triton_jit
def _ordered_keys(values):
    """Float values as int64 keys of the same order, in [0, 2**32)."""
    bits = values.to(tl.float32).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton_jit
def _exact_row(
    row_values,
    vocab,
    k,
    slot_values,
    slot_ids,
    SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    HISTOGRAM: tl.constexpr,
):
    """Write the row's ``k`` largest values (ties in column order) to its first slots, -inf
    to the rest: one program, a few bits of the values' ordered keys a pass (eight bits by
    ``tl.histogram``, or four by compares)."""
    BITS: tl.constexpr = 8 if HISTOGRAM else 4
    BINS: tl.constexpr = 1 << BITS
    offsets = tl.arange(0, BLOCK)
    digits = tl.arange(0, BINS)
    kth = tl.zeros((), tl.int64)  # the k-th largest key, found from its top bits down
    remaining = k  # of the k largest, those not yet above the bits found
    for step in range(32 // BITS):
        shift = 32 - BITS - BITS * step
        counts = tl.zeros((BINS,), tl.int32)
        for start in range(0, vocab, BLOCK):
            columns = start + offsets
            keys = _ordered_keys(tl.load(row_values + columns, mask=columns < vocab, other=0.0))
            match = ((keys >> (shift + BITS)) == (kth >> (shift + BITS))) & (columns < vocab)
            digit = ((keys >> shift) & (BINS - 1)).to(tl.int32)
            if HISTOGRAM:
                counts += tl.histogram(digit, BINS, mask=match)
            else:
                hits = (digit[:, None] == digits[None, :]) & match[:, None]
                counts += tl.sum(hits.to(tl.int32), axis=0)
        # Keys under the bits found so far whose next bits are above each digit.
        above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0)
        digit = tl.max(tl.where(above + counts >= remaining, digits, 0), axis=0)
        remaining -= tl.sum(tl.where(digits == digit, above, 0), axis=0)
        kth = kth | (digit.to(tl.int64) << shift)
    above = k - remaining  # the keys over the k-th
    written_above = tl.zeros((), tl.int32)
    written_equal = tl.zeros((), tl.int32)
    for start in range(0, vocab, BLOCK):
        columns = start + offsets
        values = tl.load(row_values + columns, mask=columns < vocab, other=0.0).to(tl.float32)
        keys = _ordered_keys(values)
        greater = (keys > kth) & (columns < vocab)
        equal = (keys == kth) & (columns < vocab)
        slots = tl.where(
            greater,
            written_above + tl.cumsum(greater.to(tl.int32), axis=0) - 1,
            above + written_equal + tl.cumsum(equal.to(tl.int32), axis=0) - 1,
        )
        keep = (greater | equal) & (slots < k)
        tl.store(slot_values + slots, values, mask=keep)
        tl.store(slot_ids + slots, columns.to(tl.int64), mask=keep)
        written_above += tl.sum(greater.to(tl.int32), axis=0)
        written_equal += tl.sum(equal.to(tl.int32), axis=0)
    rest = tl.arange(0, SLOTS)
    tl.store(slot_values + rest, float("-inf"), mask=rest >= k)
    tl.store(slot_ids + rest, 0, mask=rest >= k)


@triton_jit
def _gather_kernel(
    values_ptr,
    bound_ptr,
    slot_values_ptr,
    slot_ids_ptr,
    counters_ptr,
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """The chunk's entries at or over the row's bound, into the row's next free slots. Most
    chunks hold none, and take no atomic."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(values_ptr + row * stride_row + columns, mask=columns < vocab, other=0.0)
    values = values.to(tl.float32)
    take = (values >= tl.load(bound_ptr + row)) & (values > float("-inf")) & (columns < vocab)
    taken = take.to(tl.int32)
    count = tl.sum(taken, axis=0)
    if count > 0:
        first = tl.atomic_add(counters_ptr + row * 2 + 1, count, sem="relaxed")
        slots = first + tl.cumsum(taken, axis=0) - 1
        keep = take & (slots < SLOTS)
        tl.store(slot_values_ptr + row * SLOTS + slots, values, mask=keep)
        tl.store(slot_ids_ptr + row * SLOTS + slots, columns.to(tl.int64), mask=keep)


@triton_jit
def _redo_kernel(
    values_ptr,
    slot_values_ptr,
    slot_ids_ptr,
    counters_ptr,
    vocab,
    stride_row,
    k,
    SLOTS: tl.constexpr,
    EXACT_BLOCK: tl.constexpr,
    HISTOGRAM: tl.constexpr,
):
    """One program a row: redo a row whose entries overflowed its slots (most rows return
    at once)."""
    row = tl.program_id(0).to(tl.int64)
    # The count is reset by the select launch, not here: each warp loads it on its own, and
    # a warp loading it after another reset it would skip the redo that the others run,
    # leaving them at the redo's barriers without it.
    if tl.load(counters_ptr + row * 2 + 1) > SLOTS:
        _exact_row(
            values_ptr + row * stride_row, vocab, k, slot_values_ptr + row * SLOTS,
            slot_ids_ptr + row * SLOTS, SLOTS, EXACT_BLOCK, HISTOGRAM,
        )  # fmt: skip


@triton_jit
def _select_kernel(
    slot_values_ptr, slot_ids_ptr, counters_ptr, top_ptr, ids_ptr, k, SLOTS: tl.constexpr
):
    """One program a row: sort the slots and write the first ``k``."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(counters_ptr + row * 2 + 1, 0)  # the gathered count, ready for the next launch
    slot_values = slot_values_ptr + row * SLOTS
    slot_ids = slot_ids_ptr + row * SLOTS
    slots = tl.arange(0, SLOTS)
    keys = _ordered_keys(tl.load(slot_values + slots)) - 2147483648  # int32's range
    # Value first, then the smaller column: the order does not depend on the gathering's.
    ordered = tl.sort((keys << 32) | (0xFFFFFFFF - tl.load(slot_ids + slots)), descending=True)
    bits = (ordered >> 32).to(tl.int32)
    top = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    tl.store(top_ptr + row * k + slots, top, mask=slots < k)
    tl.store(ids_ptr + row * k + slots, 0xFFFFFFFF - (ordered & 0xFFFFFFFF), mask=slots < k)


def top_candidates_triton(
    values: torch.Tensor,
    k: int,
    chunk: int = CHUNK,
    groups: int = GROUPS,
    slots: int = SLOTS,
    exact_block: int = EXACT_BLOCK,
    gather_chunk: int = GATHER_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = values.shape
    if not 1 <= k <= min(groups, slots, vocab):
        raise ValueError(f"k must be in [1, {min(groups, slots, vocab)}], got {k}")
    if chunk % groups:
        raise ValueError(f"chunk ({chunk}) must be a multiple of groups ({groups})")
    device = values.device
    top = torch.empty(rows, k, dtype=torch.float32, device=device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    if rows == 0:
        return top, ids
    if values.stride(-1) != 1:
        values = values.contiguous()
    load_triton()
    num_chunks = cdiv(vocab, chunk)
    partial = torch.empty(rows * num_chunks * groups, dtype=values.dtype, device=device)
    bound = torch.empty(rows, dtype=torch.float32, device=device)
    slot_values = torch.empty(rows, slots, dtype=torch.float32, device=device)
    slot_ids = torch.empty(rows, slots, dtype=torch.int64, device=device)
    counters = split_counters(2 * rows, device)
    _group_max_kernel[(rows, num_chunks)](
        values, partial, bound, slot_values, slot_ids, counters, vocab, values.stride(0),
        num_chunks, k, GROUPS=groups, CHUNK=chunk, SLOTS=slots,
        FILL=next_power_of_2(cdiv(slots, num_chunks)), num_warps=4,
    )  # fmt: skip
    _gather_kernel[(rows, cdiv(vocab, gather_chunk))](
        values, bound, slot_values, slot_ids, counters, vocab, values.stride(0),
        CHUNK=gather_chunk, SLOTS=slots, num_warps=GATHER_WARPS,
    )  # fmt: skip
    _redo_kernel[(rows,)](
        values, slot_values, slot_ids, counters, vocab, values.stride(0), k, SLOTS=slots,
        EXACT_BLOCK=exact_block, HISTOGRAM=REDO_BY_HISTOGRAM, num_warps=8,
    )  # fmt: skip
    _select_kernel[(rows,)](slot_values, slot_ids, counters, top, ids, k, SLOTS=slots, num_warps=4)
    return top, ids


def top_candidates(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest values as float32, sorted descending, and their int64
    columns (see the module docstring; ``top_candidates_ref`` for the arguments)."""
    if values.dim() != 2:
        raise ValueError(f"top_candidates takes [rows, vocab] values, got {tuple(values.shape)}")
    vocab = values.shape[1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    # Narrow rows, or a k past the groups: one topk is as quick.
    if use_triton(values) and k <= GROUPS and vocab > 4 * SLOTS:
        return top_candidates_triton(values, k)
    return top_candidates_ref(values, k)
