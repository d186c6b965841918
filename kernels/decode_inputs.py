"""A decode graph's inputs, filled in one launch before each replay.

A replay reads static buffers: token ids, positions, KV slots, context lengths and each row's
block table row. They come from the step's uploaded arrays, from the persistent per-slot block
table, and, for the rows whose input token was sampled by the step before and is still only on
the device (overlapped scheduling), from the per-slot ``last_token``. With torch ops that is
seven launches (four copies, two gathers, a scatter), each a kernel of 1-5 us and a gap of
about a microsecond between two: 26 us of a batch-8 step on an H200. Here program 0 copies the
per-row arrays and then writes the pending tokens over its copy of the ids, and program
``1 + r`` copies row ``r``'s block table row.

The reference is those torch ops (``load_decode_inputs_ref``).

Both loops take fixed-size chunks, so that one compiled variant serves every batch and
every block table width. Chunks sized from each step's rows and width (the next power of
two) compiled a new variant the first time a batch's longest context crossed 16, 32, 64...
blocks, inside that step: 125 ms on an H200 from Triton's disk cache (a one-step stall at
256 tokens of context in ``bench_latency``), seconds with an empty cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.backend import load_triton, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Rows copied, and block table columns, per round of a program's loop.
ROWS_BLOCK = 256
WIDTH_BLOCK = 256

# (token ids, positions, KV slots, context lengths): the uploaded arrays and the static
# buffers they go to, each [rows].
RowArrays = Sequence[torch.Tensor]


def load_decode_inputs_ref(
    dst: RowArrays,
    src: RowArrays,
    dst_block_tables: torch.Tensor,
    slot_block_tables: torch.Tensor,
    row_slots: torch.Tensor,
    last_token: torch.Tensor,
    pending_index: torch.Tensor,
    pending_slot: torch.Tensor,
) -> None:
    """``dst[i][:] = src[i]``; block table row ``r`` (its first ``dst_block_tables.shape[1]``
    columns) from ``slot_block_tables[row_slots[r]]``; then ``ids[pending_index[j]] =
    last_token[pending_slot[j]]``."""
    for target, source in zip(dst, src):
        target.copy_(source)
    width = dst_block_tables.shape[1]
    dst_block_tables.copy_(slot_block_tables[:, :width].index_select(0, row_slots))
    if len(pending_index):
        dst[0].index_copy_(0, pending_index, last_token.index_select(0, pending_slot))


@triton_jit
def _copy_rows(src_ptr, dst_ptr, rows, num_rows):
    mask = rows < num_rows
    tl.store(dst_ptr + rows, tl.load(src_ptr + rows, mask=mask), mask=mask)


# Row, pending and column counts change from step to step: one compiled variant for all.
@triton_jit(do_not_specialize=("num_rows", "num_pending", "width"))
def _decode_inputs_kernel(
    src_ids_ptr,
    src_positions_ptr,
    src_slots_ptr,
    src_context_ptr,
    dst_ids_ptr,
    dst_positions_ptr,
    dst_slots_ptr,
    dst_context_ptr,
    slot_tables_ptr,
    row_slots_ptr,
    dst_tables_ptr,
    last_token_ptr,
    pending_index_ptr,
    pending_slot_ptr,
    num_rows,
    num_pending,
    width,
    stride_slot_table,
    stride_dst_table,
    ROWS_BLOCK: tl.constexpr,
    WIDTH_BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    if program == 0:
        for start in range(0, num_rows, ROWS_BLOCK):
            rows = start + tl.arange(0, ROWS_BLOCK)
            _copy_rows(src_ids_ptr, dst_ids_ptr, rows, num_rows)
            _copy_rows(src_positions_ptr, dst_positions_ptr, rows, num_rows)
            _copy_rows(src_slots_ptr, dst_slots_ptr, rows, num_rows)
            _copy_rows(src_context_ptr, dst_context_ptr, rows, num_rows)
        # The pending tokens overwrite the copied ids; other threads may have copied them.
        tl.debug_barrier()
        for start in range(0, num_pending, ROWS_BLOCK):
            entries = start + tl.arange(0, ROWS_BLOCK)
            mask = entries < num_pending
            rows = tl.load(pending_index_ptr + entries, mask=mask, other=0)
            slots = tl.load(pending_slot_ptr + entries, mask=mask, other=0)
            tokens = tl.load(last_token_ptr + slots, mask=mask)
            tl.store(dst_ids_ptr + rows, tokens, mask=mask)
    else:
        row = (program - 1).to(tl.int64)
        slot = tl.load(row_slots_ptr + row)
        for start in range(0, width, WIDTH_BLOCK):
            columns = start + tl.arange(0, WIDTH_BLOCK)
            mask = columns < width
            blocks = tl.load(slot_tables_ptr + slot * stride_slot_table + columns, mask=mask)
            tl.store(dst_tables_ptr + row * stride_dst_table + columns, blocks, mask=mask)


def load_decode_inputs_triton(
    dst: RowArrays,
    src: RowArrays,
    dst_block_tables: torch.Tensor,
    slot_block_tables: torch.Tensor,
    row_slots: torch.Tensor,
    last_token: torch.Tensor,
    pending_index: torch.Tensor,
    pending_slot: torch.Tensor,
) -> None:
    num_rows, width = dst_block_tables.shape
    load_triton()
    _decode_inputs_kernel[(1 + num_rows,)](
        *src,
        *dst,
        slot_block_tables,
        row_slots,
        dst_block_tables,
        last_token,
        pending_index,
        pending_slot,
        num_rows,
        len(pending_index),
        width,
        slot_block_tables.stride(0),
        dst_block_tables.stride(0),
        ROWS_BLOCK=ROWS_BLOCK,
        WIDTH_BLOCK=WIDTH_BLOCK,
        num_warps=4,
    )


def load_decode_inputs(
    dst: RowArrays,
    src: RowArrays,
    dst_block_tables: torch.Tensor,
    slot_block_tables: torch.Tensor,
    row_slots: torch.Tensor,
    last_token: torch.Tensor,
    pending_index: torch.Tensor,
    pending_slot: torch.Tensor,
) -> None:
    """Fill a decode graph's static inputs (see the module docstring). Every tensor is
    contiguous along its rows; ``dst`` and ``src`` are (ids, positions, KV slots, context
    lengths) of the same dtypes, ``[rows]`` each."""
    if len(dst) != 4 or len(src) != 4:
        raise ValueError("want (ids, positions, slots, context lengths) on both sides")
    args = (
        dst,
        src,
        dst_block_tables,
        slot_block_tables,
        row_slots,
        last_token,
        pending_index,
        pending_slot,
    )
    if use_triton(dst_block_tables):
        load_decode_inputs_triton(*args)
    else:
        load_decode_inputs_ref(*args)
