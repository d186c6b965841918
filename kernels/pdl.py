"""Programmatic dependent launch (PDL): a decode step's kernels launch while the one before
still runs.

A decode step at small batch is a chain of some 400 short kernels, each waiting for the one
before. Launched with PDL (Hopper and later), a kernel's programs are scheduled as soon as
every program of its predecessor has passed ``wait_for_inputs``; they do their index set-up
and then block in ``griddepcontrol.wait`` until the predecessor has finished and its writes
are visible. The launch and the ramp of each kernel so overlap the tail of the one before,
which is most of the gap between two kernels of a CUDA graph.

Rules every kernel launched with PDL keeps, so that no overlap can race:
- before ``wait_for_inputs`` it reads only memory written before the step's first kernel
  (context lengths, block tables, positions, weights) and writes nothing;
- ``wait_for_inputs`` lets the next kernel launch only after this one's wait, so at most the
  predecessor is still running while a program is before its wait. What the kernel two back
  wrote has therefore landed, and may be read early too, as the MoE down GEMM reads the
  grouping's layout (kernels/fused_moe.py, ``PEGAINFER_MOE_DOWN_EARLY_TILE``).

Which kernels let their successor launch early is ``launches_successor_early``. By default
all do but the GEMV of two rows that ends in the residual add (kernels/gemv.py), which lets
it launch only as it ends: launched early, the projection after it made steps of two
sequences 8% slower (3.38 against 2.98 ms, H200, Qwen3-4B, in process, alternated), its
programs placed beside the running ones. The skinny GEMM that ends in the add (o and down at
4-32 rows, kernels/skinny_gemm.py) launched its successor late too while the gate/up
projection's programs were small enough to sit two a SM beside it (3-14% slower early). Since
gate/up runs one 137 KB program a SM (132 groups), early launch gains: batch 4 / 8 / 16 / 32
2.99 / 3.08 / 3.36 / 4.06 -> 2.95 / 3.03 / 3.33 / 4.03 ms a step (tools/MEASUREMENTS.md, 12-04).
``PEGAINFER_LATE_LAUNCH`` names the kernels that launch their successor late instead, to try
another choice in whole steps.

What is read before the wait:
- decode attention reads its sequence's context length and block table; rotary its token's
  position, angles, cache slot and q/k norm weights (batch-1 steps 2.53 -> 2.50 ms at
  context 128, 8-32 rows up to 1.4% faster: their chain of loads overlaps the projection
  before);
- the o projection, which follows decode attention (latency bound, the memory bandwidth
  mostly idle), reads its first weight tiles (``prefetch`` in kernels/gemv.py; tiles in
  kernels/linear_configs.py): batch-1 steps 2.52 -> 2.46 ms at context 128;
- the one-row down GEMV, which follows the gate/up GEMV, reads one weight tile: 2.38 ->
  2.35 ms (with the weights' evict-first hint; 2.41 -> 2.40 without it); the skinny down GEMM
  does from 32 rows (batch 32 4.19 -> 4.16 ms in process; batch 8 lost, 3.16 -> 3.18);
- the one-row qkv and down GEMVs read two tiles, qkv in programs of 4 features so that they
  still fit the GPU in one round (kernels/linear_configs.py): on an H100 batch-1 steps 3.07
  -> 3.03 ms at context 128, 3.38 -> 3.34 at 4k.
Measured and not done: every one-row GEMV reading its first weight tile (2.72 against 2.70
ms a batch-1 step, an earlier version); the qkv GEMV reading one in programs of 2 features
(2.44 against 2.41 ms: its programs then no longer fit the GPU at once); the o projection copying its whole weight slice
into shared memory before the wait (Gluon's ``cp.async``; 2.51 against 2.40 ms: decode
attention's loads queued behind the 21 MB, 8.8 against 6.3 us a layer, and copying only two
tiles early that way still took 2.49); an L2 prefetch of a linear layer's weight slice and of decode attention's first
K/V tile (3.20 against 2.70 ms); decode attention reading its first K/V tile, all but the
newest token, into registers (batch 1 unchanged, 8-64 rows 6-9% slower: the peeled tile
took the kernel from 110 to 215 registers a thread, 2 programs a SM instead of 4, as
compiled offline for sm_90a by Triton 3.6); decode attention reading its first tile's
block-table entries, so that only the K/V load follows the wait (batch 1 2.37 / 2.67 ms at
context 128 / 4k against 2.37 / 2.65, batches 8 / 32 unchanged or slower); decode attention
sending its split's keys and values to L2 before the wait (sm_90's bulk prefetch, one token's
key and value a thread, no registers held: the first 64 tokens or the whole split), batch 1
2.48 against 2.36 ms at context 128 (2.70 / 2.71 against 2.62 at 4k), batch 8 3.09 / 3.15
against 3.04, batch 32 4.08 / 4.54 against 4.05 (tools/MEASUREMENTS.md, twenty-fourth session).
The kernels between two decode steps (the token readback, the upload, the graph's input
loader) launched with PDL, the upload reading the host's buffer before its wait: the stretch
from the LM head's end to the next step's first projection went from 18.3 to 13.8 us at
batch 1, yet batch-1 steps at context 128 took 2.39-2.40 ms against 2.34 (batch 8 and 32
unchanged); the cause was not found.
The skinny GEMM of 2-64 rows reading one or two weight tiles before the wait was 0.1-0.5 us
slower a projection than reading none alone (``tools/tune_linear``, nothing to overlap).
Extra programs of decode attention's grid prefetching the o projection's weight into L2 (no
wait, no fork) made batch-1 decode 2.64-2.69 ms a step against 2.60 (tools/MEASUREMENTS.md); the
same with sm_90's bulk prefetch (``cp.async.bulk.prefetch.L2``, one instruction a range,
nothing to wait for), issued by attention's own programs, 2.48 against 2.41 ms: attention's
K/V loads queued behind the prefetches, and o gained 0.3 us a layer. Each projection's own
programs sending their next weight tiles to L2 that way before the wait (one range a row)
gained nothing either: batch 1 2.36-2.41 against 2.37 ms, 8 / 32 rows 3.19-3.20 / 4.19-4.21
against 3.16 / 4.15 (tools/MEASUREMENTS.md, twentieth session).
Other late launchers than the default were measured in whole steps and none gained (decode
attention, rotary, the one-row GEMVs), nor did the late-launching skinny GEMM letting its
successor launch after its K loop rather than at its end (3% slower at 8-32 rows); nor decode attention
letting the o projection launch before its own wait (batch 1 and 8-32 rows unchanged) or after
its K loop (batch 1 2.43 against 2.37 ms at context 128).

A kernel launched without PDL (cuBLAS, torch's own) keeps full stream order on both sides.
``kernels.backend.use_pdl`` decides whether a launch uses it (never on CPU, in Triton's
interpreter, before Hopper, or with ``PEGAINFER_PDL=0``).
"""

from __future__ import annotations

import functools
import os

from kernels.backend import triton_jit

tl = None  # bound to triton.language by kernels.backend.load_triton()

# The kernels a decode step launches with PDL, by the names PEGAINFER_LATE_LAUNCH takes.
LAUNCHING_KERNELS = (
    "argmax",
    "decode_attention",
    "embedding",
    "rotary",
    "rmsnorm",
    "silu_and_mul",
    "gemv",
    "gemv_add",
    "gemv_silu",
    "rows_gemv",
    "rows_gemv_add",
    "rows_gemv_silu",
    "skinny",
    "skinny_add",
    "moe_route",
    "moe_router",
    "moe_group",
    "moe_grouped_gemm",
    "moe_sum_add_norm",
)
DEFAULT_LATE_LAUNCH = frozenset({"rows_gemv_add"})


@functools.cache
def late_launchers(setting: str | None) -> frozenset[str]:
    """The kernels named by a ``PEGAINFER_LATE_LAUNCH`` value: a comma list of
    ``LAUNCHING_KERNELS``, or ``none``; unset, ``DEFAULT_LATE_LAUNCH``."""
    if setting is None:
        return DEFAULT_LATE_LAUNCH
    names = {name.strip() for name in setting.lower().split(",") if name.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names.difference(LAUNCHING_KERNELS))
    if unknown:
        raise ValueError(
            f"PEGAINFER_LATE_LAUNCH names {', '.join(unknown)}: want none or a comma list of "
            + ", ".join(LAUNCHING_KERNELS)
        )
    return frozenset(names)


def launches_successor_early(kernel: str) -> bool:
    """Whether ``kernel`` (one of ``LAUNCHING_KERNELS``) lets the next kernel launch as soon
    as its programs have started, or only as it ends."""
    if kernel not in LAUNCHING_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}")
    return kernel not in late_launchers(os.environ.get("PEGAINFER_LATE_LAUNCH"))


def launch_successor(with_pdl: bool, kernel: str) -> bool:
    """The ``LAUNCH_SUCCESSOR`` of a launch: ``launches_successor_early`` where it uses PDL;
    elsewhere it means nothing, and the environment is not read (it costs 0.5 us a launch)."""
    return launches_successor_early(kernel) if with_pdl else True


@triton_jit
def wait_for_inputs(USE_PDL: tl.constexpr, LAUNCH_SUCCESSOR: tl.constexpr = True):
    """Block until the predecessor's writes are visible, then let the successor launch; with
    ``LAUNCH_SUCCESSOR`` false the successor launches only as this kernel ends."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if LAUNCH_SUCCESSOR:
            tl.extra.cuda.gdc_launch_dependents()


def launch_options(with_pdl: bool) -> dict[str, bool]:
    """Keyword arguments of a Triton launch: PDL asked for only where used, so a Triton
    without the option (or its interpreter) never sees it."""
    return {"launch_pdl": True} if with_pdl else {}
