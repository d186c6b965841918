"""Merging an attention's key splits inside the split kernel itself ("last program merges").

When a kernel splits keys, each program writes its rows' normalised partial output and
log-sum-exp (base 2) to float32 scratch, as before. Instead of a second kernel combining
them, every program of a group of splits then bumps that group's counter with an acq_rel
atomic; the program that sees the count reach ``num_splits - 1`` arrives last, so all the
others' partials are visible to it. It merges them (``merge_split_partials``), writes the
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


def merge_unroll(rows: int, head_dim_pad: int, num_warps: int) -> int:
    """Splits whose loads ``merge_split_partials`` keeps in flight together: as many as fit
    in about 128 registers a thread (a 16x128 decode tile: 4; a 64x128 tile: 2)."""
    per_thread = max(1, rows * head_dim_pad // (32 * num_warps))
    return max(1, min(4, 128 // per_thread))


@triton_jit
def arrive_last(counter_ptr, num_splits):
    """Count this program in at its group's counter; True for the last of ``num_splits``.

    The barrier first makes every thread of the program finish its partial stores, which the
    acq_rel atomic then publishes (release) and, in the last program, acquires the others'.
    The last program then reads them with ``merge_split_partials``'s ``.cg`` loads, never
    through a possibly stale L1.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == num_splits - 1


@triton_jit
def merge_split_partials(
    partial_out_ptr,
    partial_lse_ptr,
    row_index,
    split_stride,
    num_splits,
    row_mask,
    dims,
    head_dim,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Combine ``num_splits`` partials of ``ROWS`` rows into their softmax-weighted mean.

    Split ``s`` of row ``r`` is scratch row ``row_index[r] + s * split_stride`` (``row_index``
    int64): its output at ``partial_out_ptr + scratch_row * head_dim`` (``head_dim`` float32)
    and its base-2 log-sum-exp at ``partial_lse_ptr + scratch_row``, -inf when the split saw
    no key of the row. Every split below ``num_splits`` must have written both for every row
    in ``row_mask`` (a finite output, 0 if it saw no key). One pass with a running maximum,
    like the online softmax: a row no split saw merges to 0, never NaN. ``UNROLL`` splits'
    loads are in flight at once. Returns ``[ROWS, HEAD_DIM]`` float32.
    """
    dim_mask = dims < head_dim
    # Finite start, so exp2(m_old - m_new) is never exp2(-inf + inf).
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    # Stepped, not multiplied: an int64 ``row_index`` keeps every scratch row from overflowing.
    scratch_row = row_index
    out_mask = row_mask[:, None] & dim_mask[None, :]
    # The merge is a chain of L2 round trips on the launch's critical path: unrolled, and
    # with neither load waiting for the other, several splits' loads overlap.
    for _ in tl.range(0, num_splits, loop_unroll_factor=UNROLL):
        # Other programs wrote these: .cg reads them from L2, never from a stale L1 line.
        lse = tl.load(
            partial_lse_ptr + scratch_row, mask=row_mask, other=-float("inf"), cache_modifier=".cg"
        )
        partial = tl.load(
            partial_out_ptr + scratch_row[:, None] * head_dim + dims[None, :],
            mask=out_mask,
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + partial * weight[:, None]
        total = total * alpha + weight
        m_i = m_new
        scratch_row += split_stride
    return acc / tl.where(total > 0.0, total, 1.0)[:, None]
