"""Time the Triton linear kernels (kernels/linear.py) against cuBLAS at decode row counts.

    python -m tools.tune_linear [--preset 4b] [--rows 1,8,32,64] [--emit-table PATH]

For every projection of the model shape (qkv, o, gate_up, down, lm_head, and from two rows
gate_up_silu: gate/up ending in silu-and-mul) and every row count, each candidate tile is
timed inside one CUDA graph of ``--calls`` launches that cycle through enough copies of the
weight (at least ``--min-bytes``) that none comes from L2, as in a real forward; Triton
kernels launch with PDL as in a decode step. The table gives cuBLAS (``F.linear``; for
gate_up_silu, cuBLAS and the silu-and-mul kernel), the current default pick
(kernels/linear_configs.py) and the best candidate, each as microseconds and as bandwidth
beside the copy bandwidth measured in the same run. One row sweeps the GEMV's tiles, more
rows the skinny GEMM's (kernels/skinny_gemm.py). Candidates are compiled first in ``--jobs``
processes so the timing process finds them in Triton's cache.

``--grid 'groups=0,132'`` also times each shape with its features divided evenly over 132
programs a split (the H200's SMs), in the smallest tile that holds a program's share.

``--emit-table PATH`` writes the skinny GEMM's table (kernels/linear_configs.py) from the
sweep: per padded row count and projection the best tile, or cuBLAS where no tile beats it
by ``--min-gain``. Entries of the file already there that carry a ``note`` (set by hand from
whole decode steps) are kept unless ``--drop-hand-set``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing
import statistics
from collections.abc import Callable
from typing import Any

PRESETS = {
    # hidden, intermediate, q heads, kv heads, head_dim, vocab
    "0.6b": (1024, 3072, 16, 8, 128, 151936),
    "1.7b": (2048, 6144, 16, 8, 128, 151936),
    "4b": (2560, 9728, 32, 8, 128, 151936),
    "8b": (4096, 12288, 32, 8, 128, 151936),
    "14b": (5120, 17408, 40, 8, 128, 151936),
    "32b": (5120, 25600, 64, 8, 128, 151936),
    # Mixtures of experts: the intermediate size is an expert's. Their dense projections
    # are qkv, o, the router and the LM head; the experts are grouped GEMMs
    # (kernels/fused_moe.py, timed by tools/bench_kernels).
    "30b-a3b": (2048, 768, 32, 4, 128, 151936),
    "235b-a22b": (4096, 1536, 64, 4, 128, 151936),
}
# The router's outputs, one an expert, of the mixture presets.
NUM_EXPERTS = {"30b-a3b": 128, "235b-a22b": 128}


SILU = "gate_up_silu"
# Shared memory a skinny tile may take over its stages (of 227 KB a SM on Hopper).
_MAX_STAGE_BYTES = 160 << 10
# Weights up to this size (a mixture's router: 512 KB) are swept at any program count: no
# tile of theirs makes the hundred programs a larger weight's candidates must.
_SMALL_WEIGHT_BYTES = 4 << 20


def projections(preset: str) -> list[tuple[str, int, int]]:
    hidden, inter, heads, kv_heads, head_dim, vocab = PRESETS[preset]
    attention = [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
    ]
    if preset in NUM_EXPERTS:
        return attention + [("router", NUM_EXPERTS[preset], hidden), ("lm_head", vocab, hidden)]
    return attention + [
        ("gate_up", 2 * inter, hidden),
        (SILU, 2 * inter, hidden),
        ("down", hidden, inter),
        ("lm_head", vocab, hidden),
    ]


# The skinny GEMM's tiles swept by default; ``--grid`` replaces any of these lists.
DEFAULT_GRID: dict[str, tuple[int, ...]] = {
    "block_n": (32, 64, 128),
    "block_k": (64, 128, 256),
    "stages": (3, 4, 6),
    "split": (1, 2, 3, 4, 6, 8, 16),
    # Warps a skinny program; 0: 4, and 8 as well for 128-feature tiles.
    "warps": (0,),
    # Programs a split with the features divided evenly (kernels/skinny_gemm.py), each in the
    # smallest ``block_n`` that holds its share; 0: whole tiles of ``block_n``.
    "groups": (0,),
    # The one-row GEMV's tiles; ``gemv_stages`` is its K loop's pipeline depth (1: none).
    "gemv_block_n": (1, 2, 4, 8, 16),
    "gemv_block_k": (128, 256, 512, 1024, 2048, 4096),
    "gemv_warps": (2, 4, 8),
    "gemv_stages": (1,),
}
# Shared memory a pipelined one-row GEMV program may take for its stages.
_MAX_GEMV_STAGE_BYTES = 64 << 10


def parse_grid(spec: str) -> dict[str, tuple[int, ...]]:
    """``"split=1,3,6;stages=4"`` -> the default grid with those lists replaced."""
    grid = dict(DEFAULT_GRID)
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, values = item.partition("=")
        if name not in grid or not values:
            raise ValueError(f"--grid {item!r}: want one of {sorted(grid)} = comma-separated ints")
        grid[name] = tuple(int(v) for v in values.split(","))
    return grid


def _skinny_warps(listed: tuple[int, ...], block_n: int) -> tuple[int, ...]:
    if listed == (0,):
        return (4, 8) if block_n == 128 else (4,)
    return listed


def candidates(
    rows: int,
    n: int = 0,
    k: int = 0,
    silu_mul: bool = False,
    grid: dict[str, tuple[int, ...]] | None = None,
) -> list[Any]:
    """Tiles to time: the GEMV's at one row, the skinny GEMM's from two (for an ``N x K``
    weight, those that fit shared memory and give a sensible number of programs)."""
    from kernels.backend import cdiv, next_power_of_2
    from kernels.gemv import MAX_FEATURE_TILES
    from kernels.linear import LinearConfig
    from kernels.skinny_gemm import block_rows

    found = []
    grid = grid or DEFAULT_GRID
    if rows == 1:
        for block_n, block_k, warps, stages in itertools.product(
            grid["gemv_block_n"], grid["gemv_block_k"], grid["gemv_warps"], grid["gemv_stages"]
        ):
            fits = block_n * block_k <= 4096 * warps and block_k >= 32 * warps
            staged = (stages - 1) * (block_n + 1) * block_k * 2 <= _MAX_GEMV_STAGE_BYTES
            within_grid = not n or cdiv(n, block_n) <= MAX_FEATURE_TILES
            if fits and staged and within_grid and block_k < 2 * k:
                found.append(LinearConfig("gemv", block_n, block_k, warps, num_stages=stages))
        return found
    block_m = block_rows(rows)
    parts = 2 if silu_mul else 1
    for block_n, block_k, stages, split_k, groups in itertools.product(
        grid["block_n"], grid["block_k"], grid["stages"], grid["split"], grid["groups"]
    ):
        if (parts * block_n + block_m) * block_k * 2 * stages > _MAX_STAGE_BYTES:
            continue
        if n and k:
            features = n // parts
            if groups and (groups > features or next_power_of_2(cdiv(features, groups)) != block_n):
                continue
            programs = (groups or cdiv(features, block_n)) * split_k
            too_few = programs < 100 and n * k * 2 > _SMALL_WEIGHT_BYTES
            if too_few or programs > 8192 or cdiv(k, block_k) < 2 * split_k:
                continue
        elif groups:
            continue
        for warps in _skinny_warps(grid["warps"], block_n):
            for paired in (False, True) if silu_mul else (False,):
                found.append(
                    LinearConfig(
                        "skinny", block_n, block_k, warps, block_m, split_k, stages, paired, groups
                    )
                )
    return found


def launch(x: Any, weight: Any, config: Any, silu_mul: bool) -> Any:
    """One projection with ``config``: a Triton tile, or cuBLAS (then silu-and-mul) for None."""
    import torch.nn.functional as F

    from kernels.activation import silu_and_mul
    from kernels.linear import linear_triton
    from kernels.skinny_gemm import skinny_gemm_with

    if config is None:
        out = F.linear(x, weight)
        return silu_and_mul(out) if silu_mul else out
    if silu_mul:
        return skinny_gemm_with(x, weight, None, config, silu_mul=True)
    return linear_triton(x, weight, None, config)


def default_pick(rows: int, n: int, k: int, silu_mul: bool) -> Any:
    from kernels.linear_configs import pick_config, skinny_config

    if silu_mul:
        return skinny_config(rows, n, k, silu_mul=True) if rows > 1 else None
    return pick_config(rows, n, k)


def _compile_worker(tasks: list[tuple[int, int, int, bool, Any]]) -> int:
    import torch

    done = 0
    for rows, n, k, silu_mul, config in tasks:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            launch(x, w, config, silu_mul)
            done += 1
        except Exception:  # a config that does not compile is skipped when timed too
            pass
    torch.cuda.synchronize()
    return done


def precompile(tasks: list[tuple[int, int, int, bool, Any]], jobs: int) -> None:
    if jobs <= 1:
        _compile_worker(tasks)
        return
    chunks = [tasks[i::jobs] for i in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile_worker, chunks)


def graph_time_us(make_call: Callable[[int], Callable[[], Any]], copies: int, calls: int) -> float:
    """Microseconds per call, from a CUDA graph of ``calls`` launches over rotating inputs."""
    import torch

    fns = [make_call(i % copies) for i in range(calls)]
    for fn in fns[:copies]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def measure_one(
    name: str,
    rows: int,
    weights: list[Any],
    calls: int,
    bar: Any,
    sweep: bool = True,
    grid: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """cuBLAS, the default pick and every candidate for one projection and row count."""
    import torch

    n, k = weights[0].shape
    silu_mul = name == SILU
    x = torch.randn(rows, k, device=weights[0].device, dtype=weights[0].dtype)

    def timed(config: Any) -> float:
        return graph_time_us(
            lambda i: lambda: launch(x, weights[i], config, silu_mul), len(weights), calls
        )

    cublas = timed(None)
    bar.update()
    default_config = default_pick(rows, n, k, silu_mul)
    default = timed(default_config) if default_config is not None else cublas
    bar.update()
    results = [(default, default_config)] if default_config is not None else []
    for config in candidates(rows, n, k, silu_mul, grid) if sweep else []:
        try:
            results.append((timed(config), config))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name} rows={rows} {config}: {type(exc).__name__}: {exc}"[:300])
        bar.update()
    results.sort(key=lambda r: r[0])
    best_us, best = results[0] if results else (cublas, None)
    out_n = n // 2 if silu_mul else n
    return {
        "projection": name,
        "rows": rows,
        "n": n,
        "k": k,
        "silu_mul": silu_mul,
        "bytes": n * k * 2 + rows * (k + out_n) * 2,
        "cublas_us": cublas,
        "default_us": default,
        "default": vars(default_config) if default_config is not None else None,
        "best_us": best_us,
        "best": vars(best) if best is not None else None,
        "top5": [(round(us, 2), vars(c)) for us, c in results[:5]],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="4b", choices=sorted(PRESETS))
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--only", default="", help="comma-separated projections (default: all)")
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--min-bytes", type=int, default=512 << 20)
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument(
        "--defaults-only", action="store_true", help="time cuBLAS and the default pick only"
    )
    p.add_argument(
        "--grid",
        type=parse_grid,
        default=DEFAULT_GRID,
        help="skinny tiles to sweep: 'block_n=32,64;block_k=64,128;stages=3,4,6;split=1,2,4;"
        "' (any subset; the rest default)",
    )
    p.add_argument("--emit-table", default="", help="write the skinny GEMM's table here")
    p.add_argument("--min-gain", type=float, default=0.02, help="share a tile must beat cuBLAS by")
    p.add_argument(
        "--drop-hand-set",
        action="store_true",
        help="replace the entries of --emit-table's file that carry a note, too",
    )
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="tune_linear")
    args = p.parse_args(argv)

    import torch

    from tools.bench_common import (
        measure_copy_bandwidth,
        parse_int_list,
        print_table,
        progress,
        run_metadata,
        save_json,
    )
    from tools.linear_table import table_row, write_table

    device = torch.device("cuda")
    rows_list = parse_int_list(args.rows)
    shapes = projections(args.preset)
    if args.only:
        keep = set(args.only.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    # Compiled variants differ by K (whole chunks or not), the padded rows, the fused epilogue
    # and split or not, never by N: each is compiled once, on a weight one tile wide.
    tasks, seen = [], set()
    for name, n, k in shapes:
        silu_mul = name == SILU
        for rows in rows_list:
            for config in candidates(rows, n, k, silu_mul, args.grid):
                compiled = dataclasses.replace(config, split_k=min(config.split_k, 2))
                key = (k, rows if rows == 1 else config.block_m, silu_mul, compiled)
                if key not in seen:
                    seen.add(key)
                    tasks.append(
                        (rows, config.block_n * (2 if silu_mul else 1), k, silu_mul, config)
                    )
    if not args.defaults_only:
        print(f"compiling {len(tasks)} kernels in {args.jobs} processes", flush=True)
        precompile(tasks, args.jobs)
    copy_bw = measure_copy_bandwidth(device)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)

    def runs(name: str) -> list[int]:
        return [r for r in rows_list if r > 1 or name != SILU]

    total = sum(
        2 + (0 if args.defaults_only else len(candidates(r, n, k, name == SILU, args.grid)))
        for name, n, k in shapes
        for r in runs(name)
    )
    bar = progress(total, "tune", "config")
    records = []
    for name, n, k in shapes:
        copies = max(1, -(-args.min_bytes // (n * k * 2)))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        for rows in runs(name):
            records.append(
                measure_one(name, rows, weights, args.calls, bar, not args.defaults_only, args.grid)
            )
        del weights
        torch.cuda.empty_cache()
    bar.close()
    table = [table_row(r, copy_bw) for r in records]
    print_table(
        f"linear at decode rows, bf16, {args.preset} (TB/s and share of copy bandwidth "
        f"{copy_bw / 1e12:.2f} TB/s)",
        [
            "proj",
            "rows",
            "cuBLAS us",
            "cuBLAS TB/s",
            "default us",
            "default TB/s",
            "best us",
            "best TB/s",
            "best config",
        ],
        table,
    )
    payload = {"meta": run_metadata(argv), "copy_bandwidth": copy_bw, "results": records}
    save_json(args.out, args.name, payload)
    if args.emit_table:
        write_table(
            records,
            args.emit_table,
            args.min_gain,
            torch.cuda.get_device_name(device),
            keep_notes=not args.drop_hand_set,
        )
    return payload


if __name__ == "__main__":
    main()
