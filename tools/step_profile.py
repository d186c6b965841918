"""Where a decode step's GPU time goes: the kernels of a torch profiler trace, grouped into the
parts of a step and set beside the floor of each part's bytes at the copy bandwidth.

A decode step runs, per layer: add + RMSNorm, the QKV projection, q/k norm + rotary + KV write,
decode attention, the O projection, add + RMSNorm, gate/up, SiLU-and-mul, down; then the final
norm, the LM head and sampling. Each projection is one GEMM (cuBLAS, or a Triton GEMV at one
row), sometimes followed by cuBLAS's split-K reduction, and no two projections are adjacent:
so the n-th projection of a step is its n-th GEMM kernel with the split-K reduction that may
follow it, and projections are named by their place in the step (qkv, o, gate_up, down for
each layer, then the LM head).
When the runs do not come in whole steps of that pattern they are all counted as "gemm".

The window must hold only whole decode steps of one batch (``profile_full_decode`` in
``tools.bench_inprocess`` makes one). The step time is the span from the first kernel's start
to the last kernel's end over the steps; what the kernels do not cover is the GPU idle between
kernels: launch gaps inside a graph and anything the host makes the GPU wait for, told apart
by their length (``LONG_GAP_US``).

Kernels launched with programmatic dependent launch (kernels/pdl.py) start before the kernel
before them ends and wait for it. So that the parts and the idle time still add up to the
step, each kernel is charged only from the later of its start and the end of every kernel
before it; the time it spent alongside its predecessor is reported as overlap, and each part's
"starts" column says how early its kernels were placed (the median of their starts against
the end of the kernels before).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench_common import format_table
from tools.bench_model import ModelShape, Roofline

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# A mixture of experts' layer: the router is its third projection; the experts run grouped.
MOE_PROJECTIONS = ("qkv", "o", "router")
# At decode rows the router's projection ends in the routing (kernels/moe_router_route.py):
# the layer's projections are then qkv and o, and the router's weight is that kernel's floor.
FUSED_ROUTER = "moe router + routing + grouping"
EXPERTS = "experts (grouped GEMMs)"
LM_HEAD = "lm_head"
GEMM = "gemm"
# Substrings (lower case) of cuBLAS/CUTLASS kernel names and of the Triton linear kernels.
_GEMM_MARKERS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitkreduce", "_skinny_gemm")
# cuBLAS's split-K reduction finishes the GEMM kernel before it. Every other GEMM kernel
# starts a projection: the Triton ones are one kernel a projection, and with the norm left
# pending (kernels/linear_norm.py) or silu-and-mul in the gate/up epilogue two projections
# follow each other with no kernel between them.
_RUN_CONTINUING_MARKERS = ("splitkreduce",)
_PARTS = (
    ("_decode_split_kernel", "decode attention"),
    ("_prefill_kernel", "prefill attention"),
    ("_prefill_merge_kernel", "prefill attention"),
    ("_work_table_kernel", "prefill attention"),
    ("_rms_norm_kernel", "add + rmsnorm"),
    ("_rotary_kernel", "q/k norm + rotary + kv write"),
    ("_store_kv_kernel", "q/k norm + rotary + kv write"),
    ("_silu_and_mul_kernel", "silu x mul"),
    ("memcpy", "copies and memsets"),
    ("memset", "copies and memsets"),
)
OTHER = "other (torch ops: embedding, sampling)"
# Inside a graph consecutive kernels are about a microsecond apart; a longer gap means the
# GPU waited for something (the host's next launch, a copy).
LONG_GAP_US = 5.0


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    duration_us: float


_MOE_PARTS = (
    ("_grouped_gemm_kernel", EXPERTS),
    # Before "_route_kernel", a part of its name.
    ("_router_route_kernel", FUSED_ROUTER),
    ("_route_kernel", "moe routing + grouping"),
    ("_group_kernel", "moe routing + grouping"),
    ("_route_pairs_kernel", "moe routing + grouping"),
    ("_count_kernel", "moe routing + grouping"),
    ("_runs_kernel", "moe routing + grouping"),
    ("_place_kernel", "moe routing + grouping"),
    ("_sum_add_norm_kernel", "moe sum + add + rmsnorm"),
    ("_sum_add_square_kernel", "moe sum + add + rmsnorm"),
)


def kernel_part(name: str) -> str:
    lowered = name.lower()
    for marker, part in _MOE_PARTS:
        if marker in lowered:
            return part
    if any(marker in lowered for marker in _GEMM_MARKERS):
        return GEMM
    for marker, part in _PARTS:
        if marker in lowered:
            return part
    return OTHER


def device_kernels(prof: Any) -> list[Kernel]:
    """The device-side events (kernels, copies, memsets) of a finished torch profiler, in the
    order they started."""
    from torch.autograd import DeviceType

    kernels = [
        Kernel(evt.name, float(evt.time_range.start), float(evt.time_range.elapsed_us()))
        for evt in prof.events()
        if evt.device_type == DeviceType.CUDA
    ]
    kernels.sort(key=lambda k: k.start_us)
    return kernels


def idle_gaps(kernels: Sequence[Kernel]) -> list[float]:
    """The stretches in which no kernel ran, in order (kernels sorted by start)."""
    gaps: list[float] = []
    busy_until = kernels[0].start_us + kernels[0].duration_us
    for kernel in kernels[1:]:
        if kernel.start_us > busy_until:
            gaps.append(kernel.start_us - busy_until)
        busy_until = max(busy_until, kernel.start_us + kernel.duration_us)
    return gaps


def exclusive_times(kernels: Sequence[Kernel]) -> list[float]:
    """Each kernel's time from the later of its start and the end of every kernel before it
    to its end (zero for one wholly inside another); with the idle gaps they tile the span."""
    times: list[float] = []
    busy_until = kernels[0].start_us if kernels else 0.0
    for kernel in kernels:
        end = kernel.start_us + kernel.duration_us
        times.append(max(0.0, end - max(kernel.start_us, busy_until)))
        busy_until = max(busy_until, end)
    return times


def start_offsets(kernels: Sequence[Kernel]) -> list[float]:
    """Each kernel's start against the end of every kernel before it: negative when it was
    placed while the one before still ran (launched early with PDL, waiting on it), positive
    for an idle gap before it."""
    offsets: list[float] = []
    busy_until = kernels[0].start_us if kernels else 0.0
    for kernel in kernels:
        offsets.append(kernel.start_us - busy_until)
        busy_until = max(busy_until, kernel.start_us + kernel.duration_us)
    return offsets


def projections_of(shape: ModelShape) -> tuple[str, ...]:
    """The projections of each layer, in order: a dense layer's, or a sparse one's when every
    layer is sparse (a mix of the two is left unnamed)."""
    if shape.num_sparse_layers and shape.num_sparse_layers == shape.num_layers:
        return MOE_PROJECTIONS
    return PROJECTIONS


def label_kernels(
    kernels: Sequence[Kernel], num_layers: int, projections: Sequence[str] = PROJECTIONS
) -> list[str]:
    """Each kernel's part; GEMM runs named by their place in the step where they fit."""
    parts = [kernel_part(k.name) for k in kernels]
    if tuple(projections) == MOE_PROJECTIONS and FUSED_ROUTER in parts:
        projections = MOE_PROJECTIONS[:2]
    runs: list[list[int]] = []
    for i, part in enumerate(parts):
        if part != GEMM:
            continue
        continues = any(marker in kernels[i].name.lower() for marker in _RUN_CONTINUING_MARKERS)
        if continues and runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    per_step = len(projections) * num_layers + 1
    if runs and len(runs) % per_step == 0:
        for n, run in enumerate(runs):
            place = n % per_step
            name = LM_HEAD if place == per_step - 1 else projections[place % len(projections)]
            for i in run:
                parts[i] = name
    return parts


def between_steps(kernels: Sequence[Kernel], parts: Sequence[str]) -> dict[str, Any] | None:
    """What the GPU runs from the end of one step's LM head to the start of the next step's
    first projection (sampling, the next step's input copies, the embedding, the first norm),
    for the middle such stretch of the window: each kernel's start from the LM head's end,
    its duration and the idle gap before it. None without two named steps."""
    heads = [i for i, part in enumerate(parts) if part == LM_HEAD]
    stretches = []
    for head in heads:
        following = next((j for j in range(head + 1, len(parts)) if parts[j] == "qkv"), None)
        if following is not None:
            stretches.append((head, following))
    if not stretches:
        return None
    head, first_qkv = stretches[len(stretches) // 2]
    origin = busy_until = kernels[head].start_us + kernels[head].duration_us
    rows = []
    for kernel in kernels[head + 1 : first_qkv]:
        rows.append(
            {
                "name": kernel.name,
                "start_us": kernel.start_us - origin,
                "duration_us": kernel.duration_us,
                "gap_us": max(0.0, kernel.start_us - busy_until),
            }
        )
        busy_until = max(busy_until, kernel.start_us + kernel.duration_us)
    return {"span_us": kernels[first_qkv].start_us - origin, "kernels": rows}


def part_floors_us(
    shape: ModelShape, roof: Roofline, context_lens: Sequence[int]
) -> dict[str, float]:
    """Each weight-reading part's bytes per step (and attention's KV) at the copy bandwidth."""
    h, d, layers = shape.hidden_size, shape.head_dim, shape.num_layers
    dense = layers - shape.num_sparse_layers
    params = {
        "qkv": h * (shape.num_heads + 2 * shape.num_kv_heads) * d * layers,
        "o": shape.num_heads * d * h * layers,
        "gate_up": 2 * h * shape.intermediate_size * dense,
        "down": shape.intermediate_size * h * dense,
        LM_HEAD: shape.lm_head_params,
    }
    if shape.num_sparse_layers:
        touched = shape.experts_touched(len(context_lens))
        params["router"] = h * shape.num_experts * shape.num_sparse_layers
        params[EXPERTS] = touched * shape.expert_params * shape.num_sparse_layers
    params = {name: n for name, n in params.items() if n}
    per_s = roof.copy_bytes_per_s / 1e6
    floors = {name: n * shape.dtype_bytes / per_s for name, n in params.items()}
    kv_tokens = sum(context_lens) + len(context_lens)
    floors["decode attention"] = kv_tokens * shape.kv_bytes_per_token / per_s
    return floors


def breakdown(
    kernels: Sequence[Kernel],
    steps: int,
    shape: ModelShape,
    roof: Roofline | None = None,
    context_lens: Sequence[int] = (),
    floors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Per-step microseconds of each part, the GPU busy and idle time, and floors: a decode
    step's (``part_floors_us``) when ``roof`` is given, or ``floors`` as given."""
    if not kernels or steps < 1:
        raise ValueError("no device kernels in the window: is this a CUDA run?")
    parts = label_kernels(kernels, shape.num_layers, projections_of(shape))
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    starts: dict[str, list[float]] = {}
    for part, charged, offset in zip(parts, exclusive_times(kernels), start_offsets(kernels)):
        totals[part] = totals.get(part, 0.0) + charged
        counts[part] = counts.get(part, 0) + 1
        starts.setdefault(part, []).append(offset)
    span = max(k.start_us + k.duration_us for k in kernels) - kernels[0].start_us
    busy = sum(totals.values())
    overlap = sum(k.duration_us for k in kernels) - busy
    gaps = idle_gaps(kernels)
    if floors is None:
        floors = part_floors_us(shape, roof, context_lens) if roof is not None else {}
        if FUSED_ROUTER in totals and "router" in floors:
            floors[FUSED_ROUTER] = floors.pop("router")
    rows = [
        {
            "part": part,
            "us_per_step": total / steps,
            "kernels_per_step": counts[part] / steps,
            "share_of_step": 100.0 * total / span,
            "floor_us_per_step": floors.get(part),
            "start_us": statistics.median(starts[part]),
        }
        for part, total in sorted(totals.items(), key=lambda item: -item[1])
    ]
    return {
        "steps": steps,
        "kernels_per_step": len(kernels) / steps,
        "step_us": span / steps,
        "busy_us": busy / steps,
        "idle_us": (span - busy) / steps,
        "overlap_us": overlap / steps,
        "long_gaps_us": sum(g for g in gaps if g >= LONG_GAP_US) / steps,
        "longest_gap_us": max(gaps, default=0.0),
        "parts": rows,
        "floor_us": sum(floors.values()) if floors else None,
        "between_steps": between_steps(kernels, parts),
    }


def format_breakdown(title: str, result: dict[str, Any], num_layers: int) -> str:
    def row(
        name: str, us: float, kernels: float | None, floor: float | None, start: float | None = None
    ) -> list[Any]:
        share = 100.0 * us / result["step_us"]
        of_floor = 100.0 * floor / us if floor and us else None
        return [name, us, us / num_layers, kernels, share, floor, of_floor, start]

    rows = [
        row(
            p["part"],
            p["us_per_step"],
            p["kernels_per_step"],
            p["floor_us_per_step"],
            p.get("start_us"),
        )
        for p in result["parts"]
    ]
    rows.append(row("idle between kernels", result["idle_us"], None, None))
    if result.get("overlap_us", 0.0) > 0.0:
        rows.append(
            row("(kernel time overlapping the kernel before)", result["overlap_us"], None, None)
        )
    rows.append(
        row(f"  of it in gaps of {LONG_GAP_US:g} us or more", result["long_gaps_us"], None, None)
    )
    rows.append(
        row("step (first kernel start to last end)", result["step_us"], None, result["floor_us"])
    )
    text = format_table(
        title,
        [
            "part",
            "us/step",
            "us/layer",
            "kernels/step",
            "% of step",
            "floor us",
            "floor/time %",
            "starts us",
        ],
        rows,
    )
    text += (
        "\n(starts us: the median start of the part's kernels against the end of the kernel "
        "before; negative when launched early with PDL)"
    )
    stretch = result.get("between_steps")
    if stretch:
        text += "\n\n" + format_table(
            f"between two steps: {stretch['span_us']:.1f} us from the LM head's end to the next "
            "step's qkv",
            ["kernel", "start us", "us", "idle before us"],
            [
                [k["name"][:70], k["start_us"], k["duration_us"], k["gap_us"]]
                for k in stretch["kernels"]
            ],
        )
    return text


def summarize_profile(
    prof: Any,
    steps: int,
    shape: ModelShape,
    roof: Roofline | None,
    context_lens: Iterable[int],
    title: str,
) -> tuple[dict[str, Any], str]:
    """The breakdown of a finished profiler's window and its table."""
    result = breakdown(device_kernels(prof), steps, shape, roof, list(context_lens))
    return result, format_breakdown(title, result, shape.num_layers)
