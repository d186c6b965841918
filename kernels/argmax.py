"""Greedy token choice: the argmax of each row of the logits, in one launch.

Grid ``(rows, chunks)``: each program finds the largest value of one chunk of a row and the
first column holding it, writes that pair to scratch, and counts in at the row's counter; the
last of the row's programs to arrive reduces the chunks' pairs in chunk order, so the result
is the first column of the row's maximum whichever program finishes last, as in
``torch.argmax``. One launch with PDL replaces torch's reduction (a memset and a kernel that
took 9 us for 8 rows of a 151,936-entry vocabulary on an H200), and it can sit inside the
decode graph, right after the LM head (worker_proc/cuda_graphs.py).

A NaN counts as +inf: the row's first NaN or +inf wins. The reference is ``torch.argmax``,
which agrees except for a row holding both a NaN and an earlier +inf.
"""

from __future__ import annotations

import torch

from kernels import attention_merge, pdl
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Columns a program reads: 38 programs a row at a 151,936-entry vocabulary.
CHUNK = 4096


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab] -> [rows]`` int64: each row's first column of its maximum."""
    return logits.argmax(dim=-1)


@triton_jit
def _chunk_argmax(values, columns, vocab):
    """(largest value, first column holding it) of one tile of a row."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, columns, vocab), axis=0)


@triton_jit
def argmax_across_chunks(
    values,
    columns,
    row,
    chunk,
    num_chunks,
    vocab,
    out_ptr,
    partial_value_ptr,
    partial_index_ptr,
    counters_ptr,
    CHUNKS_PAD: tl.constexpr,
):
    """Store at ``out_ptr + row`` the first column of the row's largest value, where this
    program holds chunk ``chunk`` of ``num_chunks`` (``values`` float32 at ``columns``, -inf
    past ``vocab``): each program files its chunk's best pair, and the last of the row's
    programs to arrive reduces the pairs in chunk order, so the first column wins whichever
    program ends last."""
    best, best_column = _chunk_argmax(values, columns, vocab)
    if num_chunks == 1:
        tl.store(out_ptr + row, best_column.to(tl.int64))
    else:
        slot = row * num_chunks + chunk
        tl.store(partial_value_ptr + slot, best)
        tl.store(partial_index_ptr + slot, best_column)
        counter = counters_ptr + row
        if attention_merge.arrive_last(counter, num_chunks):
            chunks = tl.arange(0, CHUNKS_PAD)
            in_row = chunks < num_chunks
            first = row * num_chunks
            chunk_values = tl.load(
                partial_value_ptr + first + chunks,
                mask=in_row,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            chunk_columns = tl.load(
                partial_index_ptr + first + chunks, mask=in_row, other=vocab, cache_modifier=".cg"
            )
            top = tl.max(chunk_values, axis=0)
            column = tl.min(tl.where(chunk_values == top, chunk_columns, vocab), axis=0)
            tl.store(out_ptr + row, column.to(tl.int64))
            tl.store(counter, 0)  # ready for the next launch (or graph replay)


@triton_jit
def _argmax_kernel(
    logits_ptr,
    out_ptr,
    partial_value_ptr,
    partial_index_ptr,
    counters_ptr,
    vocab,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(
        logits_ptr + row * stride_row + columns, mask=columns < vocab, other=float("-inf")
    ).to(tl.float32)
    values = tl.where(values != values, float("inf"), values)
    argmax_across_chunks(
        values, columns, row, chunk, num_chunks, vocab, out_ptr, partial_value_ptr,
        partial_index_ptr, counters_ptr, CHUNKS_PAD,
    )  # fmt: skip


def argmax_rows_triton(
    logits: torch.Tensor, out: torch.Tensor | None = None, chunk: int = CHUNK
) -> torch.Tensor:
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    load_triton()
    num_chunks = cdiv(vocab, chunk)
    partial_value = torch.empty(rows * num_chunks, dtype=torch.float32, device=logits.device)
    partial_index = torch.empty(rows * num_chunks, dtype=torch.int32, device=logits.device)
    counters = split_counters(rows, logits.device)
    with_pdl = use_pdl(logits)
    _argmax_kernel[(rows, num_chunks)](
        logits,
        out,
        partial_value,
        partial_index,
        counters,
        vocab,
        logits.stride(0),
        num_chunks,
        CHUNK=chunk,
        CHUNKS_PAD=next_power_of_2(num_chunks),
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "argmax"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return out


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's first column of its maximum, ``[rows, vocab] -> [rows]`` int64, written
    into ``out`` when given."""
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows takes [rows, vocab] logits, got {tuple(logits.shape)}")
    if out is not None and (out.shape != logits.shape[:1] or out.dtype != torch.int64):
        raise ValueError(f"out must be [{logits.shape[0]}] int64, got {tuple(out.shape)}")
    if use_triton(logits):
        return argmax_rows_triton(logits, out)
    tokens = argmax_rows_ref(logits)
    if out is None:
        return tokens
    out.copy_(tokens)
    return out
