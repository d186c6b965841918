"""Merging an attention's key splits inside the split kernel itself ("last program merges").

When a kernel splits keys, each program writes its rows' normalised partial output and
log-sum-exp (base 2) to float32 scratch, as before. Instead of a second kernel combining
them, every program of a group of splits then bumps that group's counter with an acq_rel
atomic; the program that sees the count reach ``num_splits - 1`` arrives last, so all the
others' partials are visible to it. It merges them (``merge_split_chunks``), writes the
output and puts the counter back to 0. Split decode attention is thus one launch per layer.

Decode uses it: a group's merge is a few rows (the query heads of one KV head). Prefill keeps
its separate merge kernel: there one program would merge a 64-row tile over every split, a
serial read of ~0.5 MB that took a 32-token tail over 4k keys from 20 to 35 us on an H200.

The counters live in one persistent zeroed int32 buffer per device (``split_counters``).
Because every launch leaves its counters at 0, the buffer serves every layer, every step and
every replay of a CUDA graph without being cleared. A graph bakes the buffer's address in,
so a buffer is never freed once handed out: growing allocates a larger one and keeps the old.
Split launches on a device must run one after another (one stream, as in the worker): two
running at once on different streams would count into the same counters.

The skinny GEMM's splits merge the same way. Merging them through distributed shared memory
instead (a tile's splits launched as one thread-block cluster, splits 1.. storing into split
0's shared memory, one cluster barrier) gave the same bits on an H200 but was slower: the
o projection alone at 8 rows 9.5 against 8.2 us, of which the cluster launch alone (merging
through global memory) cost 0.9; decode steps at batch 8 / 32 3.14 / 4.53 against 3.00 /
3.96 ms (tools/MEASUREMENTS.md, twenty-fifth session).
"""

from __future__ import annotations

import torch

from kernels.backend import triton_jit

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Counters allocated at least: 256 KiB of int32 covers every split grid a server plans (a
# key split only happens while the grid is small), so the buffer is not regrown mid-run.
MIN_COUNTERS = 1 << 16

# (device type, device index) -> every counter buffer handed out there, the current last.
_counter_buffers: dict[tuple[str, int | None], list[torch.Tensor]] = {}


def split_counters(count: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``count`` counters, reused across launches.

    Growth happens outside CUDA-graph capture as usual. During a capture a buffer too small
    is not replaced (persistent memory must not come from the graph's pool): the launch gets
    a graph-owned zeroed buffer instead, whose clearing is captured and replays with it. The
    graphs' eager warm-up run sizes the persistent buffer first, so this is only a fallback.
    """
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()  # "cuda" and "cuda:0" share one buffer
    buffers = _counter_buffers.setdefault((device.type, index), [])
    if buffers and buffers[-1].numel() >= count:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    size = max(count, MIN_COUNTERS, 2 * buffers[-1].numel() if buffers else 0)
    buffer = torch.zeros(size, dtype=torch.int32, device=device)
    buffers.append(buffer)  # earlier buffers stay alive: captured graphs still point at them
    return buffer


@triton_jit
def arrive_last(counter_ptr, num_splits):
    """Count this program in at its group's counter; True for the last of ``num_splits``.

    The barrier first makes every thread of the program finish its partial stores, which the
    acq_rel atomic then publishes (release) and, in the last program, acquires the others'.
    The last program then reads them with ``merge_split_chunks``'s ``.cg`` loads, never
    through a possibly stale L1.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == num_splits - 1


@triton_jit
def merge_split_chunks(
    partial_out_ptr,
    partial_lse_ptr,
    first_row,
    num_splits,
    row_mask,
    dims,
    head_dim,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Combine ``num_splits`` partials of ``ROWS`` rows into their softmax-weighted mean.

    Split ``s`` of row ``r`` is scratch row ``first_row[r] + s`` (``first_row`` int64,
    ``num_splits <= SPLITS_PAD``): its output at ``partial_out_ptr + scratch_row * head_dim``
    (``head_dim`` float32) and its base-2 log-sum-exp at ``partial_lse_ptr + scratch_row``,
    -inf when the split saw no key of the row. Every split below ``num_splits`` must have
    written both for every row in ``row_mask`` (a finite output, 0 if it saw no key).

    The merge is a chain of L2 round trips on the launch's critical path, so it takes few:
    every split's log-sum-exp in one load, which fixes each split's weight up front, then
    the partial outputs ``CHUNK`` splits at a time as one ``[ROWS, CHUNK, HEAD_DIM]`` tile
    (their loads wait on nothing). A row no split saw merges to 0, never NaN. Loads are
    ``.cg``: other programs wrote these, so they come from L2, never a stale L1 line.
    Returns ``[ROWS, HEAD_DIM]`` float32."""
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(
        partial_lse_ptr + first_row[:, None] + splits[None, :],
        mask=row_mask[:, None] & (splits < num_splits)[None, :],
        other=-float("inf"),
        cache_modifier=".cg",
    )
    m = tl.max(lse, axis=1)
    m = tl.where(m > -float("inf"), m, 0.0)  # a row no split saw: all weights 0, output 0
    total = tl.sum(tl.exp2(lse - m[:, None]), axis=1)
    chunk = tl.arange(0, CHUNK)
    out_mask = (row_mask[:, None] & (dims < head_dim)[None, :])[:, None, :]
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for start in range(0, num_splits, CHUNK):
        rows = first_row[:, None] + start + chunk[None, :]  # [ROWS, CHUNK]
        in_range = row_mask[:, None] & (start + chunk < num_splits)[None, :]
        chunk_lse = tl.load(
            partial_lse_ptr + rows, mask=in_range, other=-float("inf"), cache_modifier=".cg"
        )
        weight = tl.exp2(chunk_lse - m[:, None])
        partial = tl.load(
            partial_out_ptr + rows[:, :, None] * head_dim + dims[None, None, :],
            mask=in_range[:, :, None] & out_mask,
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(partial * weight[:, :, None], axis=1)
    return acc / tl.where(total > 0.0, total, 1.0)[:, None]
