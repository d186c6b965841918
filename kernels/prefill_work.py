"""The prefill attention kernel's work table: which query tile of which sequence each of its
programs takes (kernels/prefill_attention.py).

For a varlen batch of ``num_seqs`` sequences in ``num_tokens`` query rows, the table has
``cdiv(num_tokens, queries_per_tile) + num_seqs`` int32 entries, the most any such batch
needs: ``seq << 16 | tile`` for every query tile of every sequence, in sequence order and
each sequence's tiles last-first (the late tiles of a long prompt see the most keys, and
starting them early evens out the tail of the launch), then ``-1``.

It is built on the device from ``query_start_loc``, with no host sync, so a CUDA graph
captures its construction and a replay rebuilds it for whatever batch it is given. On a GPU
that is one Triton launch: the same table from torch's elementwise ops loaded five of
torch's CUDA modules into the worker, 120 MB of host memory for a few hundred bytes of
work. ``prefill_work_table_ref`` is the PyTorch reference.
"""

from __future__ import annotations

import torch

from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_triton
from kernels.prefill_tiles import prefill_tile

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Entries a program writes, and sequences it scans per step of its loop.
ITEMS_PER_PROGRAM = 128
SEQS_PER_STEP = 64


def prefill_queries_per_tile(
    dtype: torch.dtype, head_dim: int, group: int, max_query_len: int
) -> int:
    """Queries in one program's tile with the default tile of a step whose longest query run
    is ``max_query_len`` tokens: what a work table is built for."""
    return prefill_tile(dtype, head_dim, group, max_query_len).block_m // next_power_of_2(group)


def _table_size(query_start_loc: torch.Tensor, num_tokens: int, queries_per_tile: int) -> int:
    num_seqs = query_start_loc.shape[0] - 1
    tiles = cdiv(num_tokens, queries_per_tile)
    if num_seqs >= 1 << 15 or tiles >= 1 << 16:
        raise ValueError(f"{num_tokens} tokens in {num_seqs} sequences exceed the work table")
    return tiles + num_seqs


def prefill_work_table_ref(
    query_start_loc: torch.Tensor, num_tokens: int, queries_per_tile: int
) -> torch.Tensor:
    num_items = _table_size(query_start_loc, num_tokens, queries_per_tile)
    num_seqs = query_start_loc.shape[0] - 1
    device = query_start_loc.device
    if num_seqs == 0:
        return torch.full((num_items,), -1, dtype=torch.int32, device=device)
    starts = query_start_loc.to(torch.int32)
    tiles = (starts[1:] - starts[:-1] + queries_per_tile - 1) // queries_per_tile
    ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    items = torch.arange(num_items, dtype=torch.int32, device=device)
    seq = torch.searchsorted(ends, items, right=True).clamp_(max=num_seqs - 1)
    # Item w of sequence s (its tiles at ends[s] - tiles[s] .. ends[s] - 1) takes tile
    # ends[s] - 1 - w: the last first.
    entry = (seq.to(torch.int32) << 16) | (ends[seq] - 1 - items)
    return torch.where(items < ends[-1], entry, -1)


@triton_jit(do_not_specialize=("num_seqs", "num_items", "queries_per_tile"))
def _work_table_kernel(
    query_start_loc_ptr,
    table_ptr,
    num_seqs,
    num_items,
    queries_per_tile,
    ITEMS: tl.constexpr,
    SEQS: tl.constexpr,
):
    # Each program fills ITEMS entries. Item w belongs to the sequence whose tiles span it
    # in the running count of tiles; the sequences are scanned SEQS at a time, the count
    # carried from one step to the next.
    items = tl.program_id(0) * ITEMS + tl.arange(0, ITEMS)
    owner = tl.full([ITEMS], -1, dtype=tl.int32)
    owner_end = tl.zeros([ITEMS], dtype=tl.int32)
    tiles_before = tl.full([], 0, dtype=tl.int32)
    for first in range(0, num_seqs, SEQS):
        seqs = first + tl.arange(0, SEQS)
        in_batch = seqs < num_seqs
        starts = tl.load(query_start_loc_ptr + seqs, mask=in_batch, other=0).to(tl.int32)
        ends = tl.load(query_start_loc_ptr + seqs + 1, mask=in_batch, other=0).to(tl.int32)
        tiles = (ends - starts + queries_per_tile - 1) // queries_per_tile
        tile_ends = tl.cumsum(tiles, axis=0) + tiles_before
        spans = ((tile_ends - tiles)[None, :] <= items[:, None]) & (
            items[:, None] < tile_ends[None, :]
        )
        owner = tl.maximum(owner, tl.max(tl.where(spans, seqs[None, :], -1), axis=1))
        owner_end = tl.maximum(owner_end, tl.max(tl.where(spans, tile_ends[None, :], 0), axis=1))
        tiles_before += tl.sum(tiles, axis=0)
    entry = tl.where(owner >= 0, (owner << 16) | (owner_end - 1 - items), -1)
    tl.store(table_ptr + items, entry, mask=items < num_items)


def prefill_work_table_triton(
    query_start_loc: torch.Tensor, num_tokens: int, queries_per_tile: int
) -> torch.Tensor:
    num_items = _table_size(query_start_loc, num_tokens, queries_per_tile)
    table = torch.empty(num_items, dtype=torch.int32, device=query_start_loc.device)
    load_triton()
    _work_table_kernel[(cdiv(num_items, ITEMS_PER_PROGRAM),)](
        query_start_loc,
        table,
        query_start_loc.shape[0] - 1,
        num_items,
        queries_per_tile,
        ITEMS=ITEMS_PER_PROGRAM,
        SEQS=SEQS_PER_STEP,
        num_warps=4,
    )
    return table


def prefill_work_table(
    query_start_loc: torch.Tensor, num_tokens: int, queries_per_tile: int
) -> torch.Tensor:
    """The work table of a batch of ``num_tokens`` query rows (at least its real ones) split
    at ``query_start_loc`` into sequences, for tiles of ``queries_per_tile`` queries."""
    if use_triton(query_start_loc):
        return prefill_work_table_triton(query_start_loc, num_tokens, queries_per_tile)
    return prefill_work_table_ref(query_start_loc, num_tokens, queries_per_tile)
