"""Which Triton linear kernel and tile run for ``rows x K @ K x N`` (see kernels/linear.py).

One row takes the GEMV, whose tiles below come from ``python -m tools.tune_linear`` on an
H200 (bf16), timed inside a CUDA graph with the weights cycled so that none is served from
L2; it beats cuBLAS on every Qwen3-4B projection. ``PEGAINFER_LINEAR_TILES`` replaces the
one-row tile of given shapes, so that a tile ``tune_linear`` found can be tried in a whole
decode step before it becomes a rule here: ``"N,K=block_n,block_k,num_warps[,num_stages];..."``,
e.g. ``"2560,4096=4,2048,8"``; ``num_stages`` is the weight tiles the K loop keeps in flight
(1, no pipelining, when left out). ``PEGAINFER_GEMV_STAGES`` sets that depth for every
one-row shape the overrides do not name.

Two rows take the GEMV as well, both rows in each program (``rows_gemv_config``): on an
H200 it beat the skinny GEMM on Qwen3-4B's qkv, o and down at two rows; from four rows its
multiply-adds, eight per weight element at eight rows, cost more than the tensor cores' tile.
``PEGAINFER_ROWS_GEMV=0`` sends two rows to the skinny GEMM too (``linear``: all but the
gate/up projection fused with silu-and-mul).

2-64 rows take the skinny GEMM (kernels/skinny_gemm.py) or cuBLAS, per shape, from a table
that ``tune_linear --emit-table`` writes for one kind of GPU: ``linear_tables/<GPU name>.json``
beside this file, keyed by the padded row count (16, 32, 64), N, K and whether silu-and-mul
is fused; entries set by hand say why in a ``note`` (a tile of more than half a SM's shared
memory, one program a SM, where a projection's programs otherwise doubled up on some SMs in
whole steps). ``PEGAINFER_LINEAR_TABLE=PATH`` reads another table (to try a fresh sweep in whole
steps), and ``PEGAINFER_SKINNY_GEMM=0`` sends every 2-64-row projection to cuBLAS. A shape
the table lacks takes the rule in ``skinny_rule`` up to 32 rows on a GPU of compute
capability 9.0 or later, and cuBLAS otherwise: on the H200 the skinny GEMM won every
Qwen3-4B projection at 8 and 32 rows (by 3-15%) but lost the narrow ones at 64 (by 20-30%,
each program then re-reads 64 rows of activations from L2 per weight tile).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from kernels.backend import cdiv
from kernels.gemv import MAX_FEATURE_TILES
from kernels.linear import AFTER_IDLE, AFTER_STREAM, LinearConfig
from kernels.skinny_gemm import MAX_ROWS, block_rows

MAX_TRITON_ROWS = MAX_ROWS
TABLE_DIR = Path(__file__).with_name("linear_tables")
# Programs the skinny rule splits K to reach: two per SM on a 132-SM part.
_TARGET_PROGRAMS = 264
# Output features up to which the one-row GEMV takes one feature a program (gemv_config).
FEW_FEATURES = 512


# Weight tiles the one-row GEMV's K loop keeps in flight (kernels/gemv.py): 1, none; each
# program then has one tile in flight, and its next load waits for the sum of this one.
# Pipelined tiles win alone and lose in whole steps. On an H200 (Qwen3-4B, tune_linear, weights
# out of L2) down at (4, 512, 4 warps, 4 stages) took 13.1 us against 15.3 for the rule's tile,
# o 6.8 against 7.5; in batch-1 steps (bench_latency, alternated) down so took a step at context
# 128 from 2.42 to 3.05-3.08 ms, the qkv projection after it then taking 25.5 us a layer against
# 9.1 (profiled; 3.21 ms with PDL off, so not PDL's overlap); o so 2.43, qkv at (8, 256, 2, 4)
# 2.57; every one-row GEMV at 2 / 3 stages 2.59 / 2.71. Again after the norm slots' fix (12-03),
# context 128: down at (2, 1,024, 4 warps, 2 stages) 2.42 against 2.37, o so 2.39, qkv at (2,
# 512, 2, 2) 2.45, gate/up at (4, 512, 2, 2) 2.45, every one at 2 stages 2.55. Loading each
# step's tiles one step ahead into registers instead (no shared memory) lost too (12-04): 2.44
# against 2.37 ms for every projection, 2.42 for o and down, 2.39 for gate/up.
GEMV_STAGES = 1


@functools.cache
def gemv_tile_overrides(spec: str) -> dict[tuple[int, int], LinearConfig]:
    """Parse a ``PEGAINFER_LINEAR_TILES`` value (see the module docstring)."""
    overrides: dict[tuple[int, int], LinearConfig] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        try:
            shape, tile = entry.split("=")
            n, k = (int(v) for v in shape.split(","))
            block_n, block_k, warps, *stages = (int(v) for v in tile.split(","))
            if len(stages) > 1:
                raise ValueError("too many fields")
        except ValueError as exc:
            raise ValueError(
                f"PEGAINFER_LINEAR_TILES entry {entry!r}: want N,K=block_n,block_k,num_warps"
                f"[,num_stages] ({exc})"
            ) from None
        overrides[(n, k)] = LinearConfig(
            "gemv", block_n, block_k, warps, num_stages=stages[0] if stages else 1
        )
    return overrides


def fitting_block_n(n: int, block_n: int) -> int:
    """``block_n``, doubled until ``n`` features make no more tiles than a GEMV's grid takes
    (``MAX_FEATURE_TILES``). Qwen3's 151,936-entry LM head in tiles of two makes 75,968:
    every GEMV tile goes through here, whatever its K."""
    while cdiv(n, block_n) > MAX_FEATURE_TILES:
        block_n *= 2
    return block_n


def gemv_config(n: int, k: int) -> LinearConfig:
    """The one-row GEMV tile of an ``N x K`` weight."""
    override = gemv_tile_overrides(os.environ.get("PEGAINFER_LINEAR_TILES", "")).get((n, k))
    if override is not None:
        return override
    stages = int(os.environ.get("PEGAINFER_GEMV_STAGES", GEMV_STAGES))
    if n <= FEW_FEATURES:
        # A weight of few rows (a mixture's router, 128 x 2,048) takes one feature a program
        # in 1,024-wide K tiles: 128 programs of two K steps. Alone (tools/tune_linear, H100)
        # 1.7 us against 3.1 with the rule's (2, 512) tile; Qwen3-30B-A3B's shape cut to 16
        # layers decoded one sequence at 1.14 / 1.29 ms a step at context 128 / 4k against
        # 1.15-1.16 / 1.30-1.31 (two alternated rounds; (1, 512, 2 warps) 1.15 / 1.30).
        if k >= 1024:
            return LinearConfig("gemv", 1, 1024, 4, num_stages=stages)
        return LinearConfig("gemv", 1, 512, 2, num_stages=stages)
    block_k = 1024 if k >= 4096 else 512
    # Narrow weights take two features a program, for more programs in flight. With Qwen3-4B's
    # qkv (6,144 x 2,560) at (2, 512) a decode step took 2.56 ms on an H200 at context 128
    # against 2.57 at (4, 512), and 2.83 against 2.84 at 4k (three alternated rounds, all
    # alike). Wide weights keep (4, 512): gate/up, whose fused kernel halves it, the LM head.
    # o and down (K >= 4096) take (2, 1024) with 4 warps, 1,280 programs: batch-1 steps took
    # 2.41 / 2.68 ms at context 128 / 4k against 2.45 / 2.73 with down at (1, 1024, 2 warps),
    # 2,560 programs; 2.56 / 2.84 with o so too; 3.01 / 3.29 with down at (4, 1024, 4 warps);
    # 2.42 / 2.71 with o so (H200, bench_latency, two alternated rounds).
    block_n = fitting_block_n(n, 2 if block_k == 1024 or n <= 8192 else 4)
    return LinearConfig("gemv", block_n, block_k, 4 if block_k >= 1024 else 2, num_stages=stages)


# The most rows the GEMV takes, and its K-loop stages. On an H200 (Qwen3-4B), timed alone as
# tools/tune_linear does (CUDA graphs of 24 launches, weights out of L2) but without PDL, the
# GEMV with all rows in a program against the skinny GEMM's table tile, us: at 2 rows qkv
# 9.7 / 11.8, o 7.6 / 8.8, down 14.2 / 17.3, gate/up without its activation 25.4 / 25.7; at 4
# rows 12.4 / 11.5, 8.4 / 8.7, 16.6 / 16.0, 29.1 / 25.8; at 8 rows 16.3 / 10.8, 12.4 / 8.5,
# 24.7 / 15.9, 42.2 / 25.9. With PDL, in tune_linear's chain of one kernel, the 2-row qkv took
# 12.7-13.1 us (9.6 without): each launch's programs then wait beside the one before. In whole
# decode steps of two sequences (in process, alternated) 2.82 ms against 3.13 with the skinny
# GEMM. 1, 2 and 3 stages took alike alone (qkv 13.1 / 12.2 / 12.7 us with PDL) and in steps
# (3.38 / 3.38 ms at 1 / 3, before the successor launched late).
ROWS_GEMV_MAX_ROWS = 2
ROWS_GEMV_STAGES = 1


def rows_gemv_setting() -> str:
    """``PEGAINFER_ROWS_GEMV``: ``all`` (the default: the projections and the gate/up
    projection fused with silu-and-mul), ``linear`` (the plain projections only; gate/up
    keeps the skinny GEMM) or ``off`` (0)."""
    setting = os.environ.get("PEGAINFER_ROWS_GEMV", "all").lower()
    if setting in ("0", "false", "off"):
        return "off"
    if setting not in ("all", "1", "linear"):
        raise ValueError(f"PEGAINFER_ROWS_GEMV={setting!r}: want all, linear or off")
    return "linear" if setting == "linear" else "all"


def rows_gemv_config(num_rows: int, n: int, k: int) -> LinearConfig | None:
    """The GEMV tile for 2 to ``ROWS_GEMV_MAX_ROWS`` rows, all in one program, or None. The
    tile of the sweep above: two features by 1,024 of K (4 warps) for K of 4,096 and more,
    four by 512 (2 warps) below, so that each thread's rows x features stay in registers."""
    if not 1 < num_rows <= ROWS_GEMV_MAX_ROWS or rows_gemv_setting() == "off":
        return None
    block_m = 1 << (num_rows - 1).bit_length()
    stages = int(os.environ.get("PEGAINFER_ROWS_GEMV_STAGES", ROWS_GEMV_STAGES))
    if k >= 4096:
        return LinearConfig(
            "gemv", fitting_block_n(n, 2), 1024, 4, block_m=block_m, num_stages=stages
        )
    return LinearConfig("gemv", fitting_block_n(n, 4), 512, 2, block_m=block_m, num_stages=stages)


def skinny_rule(num_rows: int, n: int, k: int, silu_mul: bool = False) -> LinearConfig:
    """The skinny GEMM's tile for a shape no table holds: 64 features by 128 of K, split
    over K until about two programs per SM, each split at least four K steps long."""
    block_n, block_k = 64, 128
    tiles = cdiv(n // 2 if silu_mul else n, block_n)
    split_k = 1
    while tiles * split_k < _TARGET_PROGRAMS and cdiv(k, block_k) >= split_k * 8:
        split_k *= 2
    return LinearConfig("skinny", block_n, block_k, 4, block_rows(num_rows), split_k, num_stages=4)


TableKey = tuple[int, int, int, bool]


def parse_table(payload: dict[str, Any]) -> dict[TableKey, LinearConfig | None]:
    """``{(block_m, n, k, silu_mul): config, or None for cuBLAS}`` from a table's JSON."""
    table: dict[TableKey, LinearConfig | None] = {}
    for entry in payload["entries"]:
        key = (int(entry["block_m"]), int(entry["n"]), int(entry["k"]), bool(entry["silu_mul"]))
        if entry["kind"] == "cublas":
            table[key] = None
            continue
        table[key] = LinearConfig(
            "skinny",
            int(entry["block_n"]),
            int(entry["block_k"]),
            int(entry["num_warps"]),
            key[0],
            int(entry["split_k"]),
            int(entry["num_stages"]),
            bool(entry.get("paired", False)),
            int(entry.get("groups", 0)),
        )
    return table


def keep_hand_set(payload: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    """Carry the entries of ``previous`` that were set by hand (those with a ``note``) into a
    freshly swept ``payload``, in place of the sweep's entry for the same shape: a sweep times
    each kernel alone, and those entries record what whole decode steps measured instead.
    Returns the entries carried."""

    def key(entry: dict[str, Any]) -> TableKey:
        return (int(entry["block_m"]), int(entry["n"]), int(entry["k"]), bool(entry["silu_mul"]))

    kept = [entry for entry in previous.get("entries", []) if entry.get("note")]
    by_key = {key(entry): entry for entry in kept}
    swept = [entry for entry in payload["entries"] if key(entry) not in by_key]
    payload["entries"] = sorted(swept + kept, key=key)
    return kept


def table_path(device_name: str) -> Path:
    return TABLE_DIR / (device_name.replace(" ", "_") + ".json")


@functools.cache
def _load_table(path: str) -> dict[TableKey, LinearConfig | None]:
    file = Path(path)
    if not file.is_file():
        return {}
    return parse_table(json.loads(file.read_text()))


@functools.cache
def _device() -> tuple[str, int]:
    """(name, compute capability major) of the current CUDA device, ("", 0) without one."""
    import torch

    if not torch.cuda.is_available():
        return "", 0
    index = torch.cuda.current_device()
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)[0]


def skinny_config(num_rows: int, n: int, k: int, silu_mul: bool = False) -> LinearConfig | None:
    """The skinny GEMM's tile for 2-64 rows, or None where cuBLAS runs the projection."""
    if os.environ.get("PEGAINFER_SKINNY_GEMM", "1") in ("0", "false", "off"):
        return None
    name, major = _device()
    path = os.environ.get("PEGAINFER_LINEAR_TABLE") or str(table_path(name))
    key = (block_rows(num_rows), n, k, silu_mul)
    table = _load_table(path)
    if key in table:
        return table[key]
    if (name and major < 9) or key[0] > 32:
        return None
    return skinny_rule(num_rows, n, k, silu_mul)


# Weight tiles a projection reads before its PDL wait, by what the kernel before it leaves
# of the memory bandwidth (``AFTER_IDLE``, ``AFTER_STREAM`` in kernels/linear.py; the layers
# say which in worker_proc/models/llama.py). After decode attention, which leaves the
# bandwidth mostly idle (the o projection); H200, Qwen3-4B, alternated in process: batch-1 steps at
# context 128 / 4k took 2.46 / 2.74 ms with two one-row GEMV tiles (2 x 1,024 of K a program,
# half of o's weight) against 2.52 / 2.79 with none, 2.48 / 2.76 with one, 2.52 / 2.79 with
# three, 2.51 / 2.76 with four. At 8 / 16 / 32 rows two skinny GEMM tiles gave 3.21 / 3.51 /
# 4.24 ms against 3.22 / 3.51 / 4.28 with none, four the same as two. The environment's
# ``PEGAINFER_GEMV_PREFETCH_TILES`` and ``PEGAINFER_SKINNY_PREFETCH_TILES`` replace them.
GEMV_PREFETCH_TILES = 2
SKINNY_PREFETCH_TILES = 2
MAX_PREFETCH_TILES = 2
# The GEMV of two rows reads one: with two, the o projection's 2-row programs need 56
# registers, 9 a SM, and 1,280 of them no longer fit the GPU at once (48 registers, 10 a SM,
# with one). Steps of two sequences took 2.78 ms with one against 2.82 with two (in process,
# alternated).
ROWS_GEMV_PREFETCH_TILES = 1
# After a bandwidth-bound GEMV (down after gate/up, qkv after down), one-row tiles fill the
# gap between the two kernels' streams. Down with one: with the weights' loads marked
# evict_first, batch-1 steps at context 128 / 4k took 2.35 / 2.63 ms against 2.38 / 2.66 with
# none (H200, Qwen3-4B, two alternated rounds); without the eviction hint 2.40 / 2.67 against
# 2.41 / 2.68. The qkv projection with one tile took 2.44 / 2.71 against 2.41 / 2.68: its
# programs of 2 features (2 warps) then need 45 registers and no longer fit the GPU in one
# round, so a prefetching one-row GEMV takes 4 features where the rule gives 2 of a 512-wide K
# tile (``prefetching_gemv_config``: compiled for sm_90, 70 registers, 14 programs a SM,
# Qwen3-4B's 1,536 qkv programs in one round). On an H100 (Qwen3-4B, copy 3.0 TB/s, bench_latency, alternated
# rounds on one machine) steps at context 128 / 4k took 3.021-3.031 / 3.333-3.337 ms with two
# tiles for qkv and down (four rounds) against 3.070-3.077 / 3.376-3.380 with one for down and
# none for qkv (six rounds); qkv with one tile 3.043 / 3.35 (two rounds); qkv with two and
# down with one 3.023-3.028 / 3.333-3.338; down with two alone 3.068 / 3.38. On an H200 (copy
# 4.1 TB/s, two alternated rounds) two for both took 2.34-2.35 / 2.60 ms, one 2.36 / 2.61-2.62,
# none 2.41 / 2.68; against the code before (down one, qkv none) 2.34-2.35 / 2.61 and 2.36 / 2.62.
# ``PEGAINFER_GEMV_STREAM_PREFETCH_TILES`` replaces it.
GEMV_STREAM_PREFETCH_TILES = 2
# The skinny GEMM after a stream (down, after gate/up) reads one tile from 32 rows and none
# below: in process, alternated, one tile took batch 32 from 4.19 to 4.16 ms a step and batch
# 8 from 3.16 to 3.18, two tiles 4.16 and 3.20 (H200, Qwen3-4B, 1,024-token prompts); on
# another machine batch 32 4.13 -> 4.10.
# ``PEGAINFER_SKINNY_STREAM_PREFETCH_TILES`` replaces it at every row count.
SKINNY_STREAM_PREFETCH_TILES = 1
SKINNY_STREAM_PREFETCH_MIN_ROWS = 32


# The one-row gate/up GEMV fused with silu-and-mul (kernels/linear_fused.py) follows the o
# projection's stream, as qkv follows down's: it reads two weight tiles (a gate and an up row's
# each) before its wait, in programs of two features where the rule gives one (4,864 programs
# of Qwen3-4B, 14 a SM, against 9,728 of 25). On an H100 (Qwen3-4B, copy 3.0 TB/s,
# bench_latency, two alternated rounds) batch-1 steps at context 128 / 4k took 2.97 / 3.28 ms
# against 3.03 / 3.34 with none (2.98 / 3.30 with two tiles in programs of one feature; 3.05 /
# 3.36 with one tile; 3.04 / 3.36 with four features a program, 3.01 / 3.34 with two in 4-warp
# programs, against 3.02 / 3.33 in that call). The paired skinny gate/up GEMM of 8 and 32 rows
# reading one or two tiles early gained nothing (in process, 3.80 / 5.15 ms a step against
# 3.82-3.83 / 5.15-5.16).
# Hidden sizes of 4,096 and more (Qwen3-8B to 32B) take 1,024-wide K tiles in 4-warp
# programs, where two early tiles hold half of K and leave 7 programs a SM against 12
# (tools/kernel_resources). They gain as well, on an H100 (same benchmark): Qwen3-8B 5.17 /
# 5.49 ms against 5.24 / 5.55 with none (5.26 / 5.56 with one tile), Qwen3-14B 9.27 / 9.71
# against 9.33 / 9.77.
# ``PEGAINFER_GATE_UP_PREFETCH_TILES`` replaces it at every size.
GATE_UP_PREFETCH_TILES = 2


def gate_up_prefetch_tiles(k: int, block_k: int) -> int:
    """Weight tiles of the one-row fused gate/up GEMV read before its wait."""
    tiles = int(os.environ.get("PEGAINFER_GATE_UP_PREFETCH_TILES", GATE_UP_PREFETCH_TILES))
    return max(0, min(tiles, MAX_PREFETCH_TILES, cdiv(k, block_k)))


# The fused gate/up GEMV of two rows (``linear_silu_and_mul_rows``) reads two tiles before its
# wait where its K tiles are 512 wide (hidden sizes below 4,096), none where they are 1,024.
# On an H100, in process (bench_throughput --engine inprocess --batches 1,2 --output-len 64,
# two alternated rounds), steps of two Qwen3-4B sequences took 3.40 ms with two tiles against
# 3.43 with one and 3.46 with none (4,864 programs of 80 / 64 / 48 registers, 12 / 16 / 21 a
# SM); two of Qwen3-8B (4-warp programs of one feature, 1,024-wide tiles) 5.88 with two and
# 5.89-5.90 with one against 5.85-5.86 with none.
# ``PEGAINFER_ROWS_GATE_UP_PREFETCH_TILES`` replaces it at every size.
ROWS_GATE_UP_PREFETCH_TILES = 2
ROWS_GATE_UP_PREFETCH_MAX_BLOCK_K = 512


def rows_gate_up_prefetch_tiles(k: int, block_k: int) -> int:
    """Weight tiles of the fused gate/up GEMV of two rows read before its wait."""
    rule = ROWS_GATE_UP_PREFETCH_TILES if block_k <= ROWS_GATE_UP_PREFETCH_MAX_BLOCK_K else 0
    tiles = int(os.environ.get("PEGAINFER_ROWS_GATE_UP_PREFETCH_TILES", rule))
    return max(0, min(tiles, MAX_PREFETCH_TILES, cdiv(k, block_k)))


def fused_gate_up_block_n(rule_block_n: int, n: int, k: int, prefetching: bool) -> int:
    """Features a program of the one-row fused gate/up GEMV of an ``N x K`` ``[gate | up]``
    weight: two where the rule gives one and the program reads tiles before its wait, unless
    ``PEGAINFER_LINEAR_TILES`` sets the tile."""
    if not prefetching or rule_block_n != 1:
        return rule_block_n
    if (n, k) in gemv_tile_overrides(os.environ.get("PEGAINFER_LINEAR_TILES", "")):
        return rule_block_n
    return 2


def prefetch_tiles(config: LinearConfig, k: int, after: str = AFTER_IDLE) -> int:
    """The weight tiles a launch of ``config`` over ``k`` input features reads before its
    wait, after a kernel of the kind ``after`` names: at most one split's."""
    if after not in (AFTER_IDLE, AFTER_STREAM):
        raise ValueError(f"unknown prefetch {after!r}: want {AFTER_IDLE!r} or {AFTER_STREAM!r}")
    if config.kind == "gemv":
        if after == AFTER_IDLE:
            rule = GEMV_PREFETCH_TILES if config.block_m == 1 else ROWS_GEMV_PREFETCH_TILES
            tiles = int(os.environ.get("PEGAINFER_GEMV_PREFETCH_TILES", rule))
        else:
            # Two rows keep one tile, as after attention (ROWS_GEMV_PREFETCH_TILES).
            rule = GEMV_STREAM_PREFETCH_TILES if config.block_m == 1 else ROWS_GEMV_PREFETCH_TILES
            tiles = int(os.environ.get("PEGAINFER_GEMV_STREAM_PREFETCH_TILES", rule))
        span = k
    else:
        if after == AFTER_IDLE:
            tiles = int(os.environ.get("PEGAINFER_SKINNY_PREFETCH_TILES", SKINNY_PREFETCH_TILES))
        else:
            rule = SKINNY_STREAM_PREFETCH_TILES
            if config.block_m < SKINNY_STREAM_PREFETCH_MIN_ROWS:
                rule = 0
            tiles = int(os.environ.get("PEGAINFER_SKINNY_STREAM_PREFETCH_TILES", rule))
        span = cdiv(k, config.split_k)
    return max(0, min(tiles, MAX_PREFETCH_TILES, cdiv(span, config.block_k)))


def prefetching_gemv_config(config: LinearConfig, n: int, k: int) -> LinearConfig:
    """The one-row GEMV tile of an ``N x K`` projection that reads weight tiles before its
    wait: 4 features a program where the rule gives 2 of a 512-wide K tile, so that its
    programs, holding the early tiles in registers, still fit the GPU in one round (see
    ``GEMV_STREAM_PREFETCH_TILES``). A tile set by ``PEGAINFER_LINEAR_TILES`` is kept."""
    if config.kind != "gemv" or config.block_m != 1 or (config.block_n, config.block_k) != (2, 512):
        return config
    if (n, k) in gemv_tile_overrides(os.environ.get("PEGAINFER_LINEAR_TILES", "")):
        return config
    return replace(config, block_n=4)


def pick_config(num_rows: int, n: int, k: int) -> LinearConfig | None:
    """The Triton kernel for ``num_rows`` rows of an ``N x K`` weight; None: cuBLAS."""
    if num_rows == 1:
        return gemv_config(n, k)
    rows_gemv = rows_gemv_config(num_rows, n, k)
    if rows_gemv is not None:
        return rows_gemv
    if num_rows <= MAX_ROWS:
        return skinny_config(num_rows, n, k)
    return None
